"""Calibration reader: measured kernel times → the cost model's op times.

A calibration file (schema: DEVELOPERS.md "Calibration file") holds measured seconds of vLLM's
kernels per op family, in each family's own coordinates:

=====================  ======================================================  ==============
family                 key coordinates (one measured curve per key)            swept over
=====================  ======================================================  ==============
``gemm``               dtype; n, k                                             m (tokens)
``decode_attention``   kv_dtype; head_dim, num_kv_heads, num_heads, batch      context
``prefill_attention``  kv_dtype; head_dim, num_kv_heads, num_heads, batch,     chunk
                       context (cached tokens before the chunk)
``allreduce``          mode (graph | eager), dtype; tp                         bytes
``moe``                dtype, distribution; hidden, inter, topk, experts,      tokens
                       tp, ep
=====================  ======================================================  ==============

A row is one curve (the swept coordinate and ``seconds`` are lists) or one point (scalars;
version-1 rows with ``triton_s``/``vendor_s`` take the faster of the two). Lookups
(:class:`Table`):

- **inside** the measured grid: multilinear interpolation of *time* in the raw coordinates
  (exact at table points; exact for ``t = floor + a·x`` kernels between points). Prefill chunks
  interpolate in causal (query, key) pairs ``chunk·context + chunk(chunk+1)/2``; MoE curves run
  over tokens per expert ``tokens·topk/experts``.
- **outside** (beyond a curve's range, a key not measured, a grid corner missing): the
  roofline of the requested shape times the nearest measured point's ``time / roofline``
  (its efficiency), never below that curve's fastest time (the kernel's latency floor).
  Provenance then reads ``roofline:nearest/<source>``; inside it reads
  ``calibration:<source>``.

Roofline seconds (peaks from the hardware spec) per family:

- GEMM: ``max(2mnk / peak, (n·k·w + m·k·a + m·n·2) / bw)`` (w, a: weight/activation bytes).
- decode: ``max(4·H·D·b·ctx / peak, (2·b·ctx·Hkv·D·kv + 2·b·H·D·2) / bw)``.
- prefill: ``max(4·H·D·b·pairs / peak, b·(2·(ctx + chunk)·Hkv·D·kv + 2·chunk·H·D·2) / bw)``.
- all-reduce: ``2(tp − 1)/tp · bytes / link_bw``.
- MoE: ``max(6·T·topk·h·i/tp / peak, E_act·3·h·i/tp·w / bw)``, E_act = E(1 − (1 − topk/E)^T).

``hardware.calibration: auto`` layers the user's own measured file
(``$SERVESIM_CALIBRATION_DIR/<gpu>.yaml``, default ``~/.config/servesim/calibration``) over
the shipped ``configs/calibration/<gpu>.yaml``: per family, the first file that has rows wins.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import itertools
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from servesim.costmodels.config import HardwareConfig
from servesim.costmodels.specs import HardwareSpec, _read_mapping, configs_dir
from servesim.simulator.errors import ConfigError

STALE_DAYS = 180
ACT = 2  # activation bytes (bf16/fp16)

# GEMM table dtypes: (weight bytes, activation bytes, tensor rate used)
GEMM_DTYPES = {"bfloat16": (2.0, 2.0, "bf16"), "fp8": (1.0, 1.0, "fp8"),
               "fp8_block": (1.0, 1.0, "fp8"), "int8": (1.0, 1.0, "int8")}
_DTYPE_ALIASES = {"float16": "bfloat16", "bf16": "bfloat16", "fp16": "bfloat16",
                  "float8_e4m3fn": "fp8", "float8_e4m3": "fp8", "float8": "fp8",
                  "fp8_e4m3": "fp8"}
KV_BYTES = {"bfloat16": 2, "fp8": 1}


def norm_dtype(dt) -> str:
    """Canonical dtype label (``float16``/``bf16`` → ``bfloat16``, ``float8_e4m3fn`` → ``fp8``)."""
    s = str(dt or "bfloat16")
    return _DTYPE_ALIASES.get(s, s)


@dataclass(frozen=True)
class Family:
    """How one op family's rows map to tables: categorical columns pick the table, numeric
    ``keys`` pick the curve, ``sweep`` runs along it."""

    name: str
    cats: tuple[str, ...]
    keys: tuple[str, ...]
    sweep: str


FAMILIES = {
    "gemm": Family("gemm", ("dtype",), ("n", "k"), "m"),
    "decode_attention": Family("decode_attention", ("kv_dtype",),
                               ("head_dim", "num_kv_heads", "num_heads", "batch"), "context"),
    "prefill_attention": Family("prefill_attention", ("kv_dtype",),
                                ("head_dim", "num_kv_heads", "num_heads", "batch", "context"),
                                "chunk"),
    "allreduce": Family("allreduce", ("mode", "dtype"), ("tp",), "bytes"),
    "moe": Family("moe", ("dtype", "distribution"),
                  ("hidden", "inter", "topk", "experts", "tp", "ep"), "tokens"),
}
_CAT_DEFAULTS = {"dtype": "bfloat16", "kv_dtype": None, "mode": "graph",
                 "distribution": "balanced"}
_KEY_DEFAULTS = {"context": 0, "ep": 1, "batch": 1}


class CalibrationWarning(UserWarning):
    """A calibration file is missing for the GPU, stale, or for another GPU."""


_warned: set[str] = set()


def _warn(msg: str) -> None:
    """One-line warning, once per process per message."""
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, CalibrationWarning, stacklevel=3)


def _l(x: float) -> float:
    return math.log1p(max(x, 0.0))


def _pairs(chunk: float, context: float) -> float:
    """Causal (query, key) pairs of a ``chunk`` after ``context`` cached tokens."""
    return chunk * context + chunk * (chunk + 1) / 2


# ---------------------------------------------------------------------------------------------
# interpolation


class Series:
    """One measured curve: seconds over the swept coordinate (sorted, duplicates averaged),
    linear between points in ``u = warp(x)``."""

    __slots__ = ("tmin", "ts", "us", "warp", "xs")

    def __init__(self, pts: list[tuple[float, float]], warp: Callable[[float], float] | None):
        agg: dict[float, list[float]] = defaultdict(list)
        for x, t in pts:
            agg[x].append(t)
        self.xs = sorted(agg)
        self.ts = [sum(agg[x]) / len(agg[x]) for x in self.xs]
        self.warp = warp
        self.us = [warp(x) for x in self.xs] if warp else self.xs
        self.tmin = min(self.ts)

    def at(self, x: float, skip: int | None = None) -> tuple[float, float, bool]:
        """(seconds, x measured nearest, inside). Outside the range: the end point's time and
        x (the caller scales by roofline). ``skip``: leave that point out (the check)."""
        xs, us, ts = self.xs, self.us, self.ts
        if skip is not None:
            xs, us, ts = xs[:skip] + xs[skip + 1:], us[:skip] + us[skip + 1:], \
                ts[:skip] + ts[skip + 1:]
        if x <= xs[0]:
            return ts[0], xs[0], x == xs[0]
        if x >= xs[-1]:
            return ts[-1], xs[-1], x == xs[-1]
        i = bisect.bisect_left(xs, x)
        if xs[i] == x:
            return ts[i], x, True
        u = self.warp(x) if self.warp else x
        u0, u1 = us[i - 1], us[i]
        w = (u - u0) / (u1 - u0) if u1 != u0 else 0.0
        return ts[i - 1] + w * (ts[i] - ts[i - 1]), x, True


Roof = Callable[[tuple, float], float]


class Table:
    """Measured curves of one family and one categorical combination, keyed by numeric
    coordinates; :meth:`lookup` interpolates or falls back (module docstring)."""

    def __init__(self, keys: tuple[str, ...], sweep: str, series: dict[tuple, Series],
                 roof: Roof):
        self.keys, self.sweep, self.series, self.roof = keys, sweep, series, roof
        self.axes = [sorted({k[i] for k in series}) for i in range(len(keys))]

    def __len__(self) -> int:
        return sum(len(s.xs) for s in self.series.values())

    @staticmethod
    def _bracket(ax: list[float], v: float) -> tuple[list[tuple[float, float]], float, bool]:
        """[(value, weight)], clamped value, inside."""
        if v <= ax[0]:
            return [(ax[0], 1.0)], ax[0], v == ax[0]
        if v >= ax[-1]:
            return [(ax[-1], 1.0)], ax[-1], v == ax[-1]
        i = bisect.bisect_left(ax, v)
        if ax[i] == v:
            return [(v, 1.0)], v, True
        lo, hi = ax[i - 1], ax[i]
        w = (v - lo) / (hi - lo)
        return [(lo, 1.0 - w), (hi, w)], v, True

    def nearest(self, key: tuple) -> tuple:
        """Measured key nearest to ``key`` (log distance over the key coordinates)."""
        lk = [_l(v) for v in key]
        return min(self.series, key=lambda k: sum((_l(a) - b) ** 2 for a, b in zip(k, lk)))

    def support(self, key: tuple) -> set[tuple]:
        """The measured curve keys a lookup at ``key`` reads (grid corners, else nearest)."""
        if key in self.series:
            return {key}
        corners = [tuple(v for v, _ in c) for c in itertools.product(
            *(self._bracket(ax, v)[0] for ax, v in zip(self.axes, key)))]
        if all(c in self.series for c in corners):
            return set(corners)
        return {self.nearest(key)}

    def _curve(self, key: tuple, x: float, skip: int | None = None) -> tuple[float, bool]:
        s = self.series[key]
        t, xe, inside = s.at(x, skip)
        if not inside:
            r = self.roof(key, xe)
            floor = s.tmin if skip is None else min(s.ts[:skip] + s.ts[skip + 1:])
            t = max(t * self.roof(key, x) / r, floor) if r > 0 else t
        return t, inside

    def lookup(self, key: tuple, x: float) -> tuple[float, bool]:
        """(seconds, inside) at ``key`` and swept coordinate ``x``."""
        s = self.series.get(key)
        if s is not None:
            return self._curve(key, x)
        inside = True
        brackets = []
        kc = []
        for ax, v in zip(self.axes, key):
            br, vc, ok = self._bracket(ax, v)
            brackets.append(br)
            kc.append(vc)
            inside &= ok
        kc = tuple(kc)
        corners = list(itertools.product(*brackets))
        if all(tuple(v for v, _ in c) in self.series for c in corners):
            t = 0.0
            floor = math.inf
            for c in corners:
                ck = tuple(v for v, _ in c)
                w = math.prod(w for _, w in c)
                tc, ok = self._curve(ck, x)
                t += w * tc
                inside &= ok
                floor = min(floor, self.series[ck].tmin)
        else:
            kc = self.nearest(key)
            t, _ = self._curve(kc, x)
            floor = self.series[kc].tmin
            inside = False
        if kc != key:
            r = self.roof(kc, x)
            if r > 0:
                t = t * self.roof(key, x) / r
                if t < floor and self.roof(key, x) < r:
                    t = floor
        return t, inside

    def loo(self, key: tuple, i: int) -> float | None:
        """Seconds predicted for point ``i`` of curve ``key`` from the other points of that
        curve (leave-one-out along the swept coordinate; ends: roofline × neighbour eff);
        None for a one-point curve."""
        s = self.series[key]
        if len(s.xs) < 2:
            return None
        return self._curve(key, s.xs[i], skip=i)[0]


# ---------------------------------------------------------------------------------------------
# the calibration


class Peaks:
    """Roofline rates (FLOP/s, bytes/s) of the calibrated GPU."""

    def __init__(self, spec: HardwareSpec | None, doc_peaks: dict, where: str):
        def pick(key: str, fallback):
            v = (doc_peaks or {}).get(key)
            if v is None:
                v = fallback
            return float(v) if v else None

        bf16 = pick("bf16_tflops", spec.bf16_tflops if spec else None)
        bw = pick("mem_bw_gbps", spec.mem_bw_gbps if spec else None)
        if not bf16 or not bw:
            raise ConfigError(f"{where}: peaks.bf16_tflops and peaks.mem_bw_gbps are required")
        self.bf16 = bf16 * 1e12
        self.fp8 = (pick("fp8_tflops", spec.fp8_tflops if spec else None) or bf16) * 1e12
        self.int8 = (pick("int8_tops", spec.int8_tops if spec else None) or bf16) * 1e12
        self.bw = bw * 1e9
        self.link = (pick("link_bw_gbps", spec.link_bw_gbps if spec else None) or 32.0) * 1e9

    def rate(self, compute: str) -> float:
        return {"fp8": self.fp8, "int8": self.int8}.get(compute, self.bf16)


def gemm_roof(p: Peaks, m: float, n: float, k: float, wb: float, ab: float,
              compute: str) -> float:
    """Roofline seconds of ``y[m,n] = x[m,k] · W[n,k]ᵀ`` (bf16 output)."""
    return max(2.0 * m * n * k / p.rate(compute), (n * k * wb + m * k * ab + m * n * ACT) / p.bw)


def decode_roof(p: Peaks, head_dim, kv_heads, heads, batch, context, kvb: float) -> float:
    return max(4.0 * heads * head_dim * batch * context / p.bf16,
               (2.0 * batch * context * kv_heads * head_dim * kvb
                + 2.0 * batch * heads * head_dim * ACT) / p.bw)


def prefill_roof(p: Peaks, head_dim, kv_heads, heads, batch, context, chunk, kvb: float) -> float:
    return max(4.0 * heads * head_dim * batch * _pairs(chunk, context) / p.bf16,
               batch * (2.0 * (context + chunk) * kv_heads * head_dim * kvb
                        + 2.0 * chunk * heads * head_dim * ACT) / p.bw)


def moe_roof(p: Peaks, hidden, inter, topk, experts, tp, ep, tpe: float, wb: float,
             compute: str) -> float:
    """``tpe``: tokens per expert (= tokens·topk/experts)."""
    tokens = tpe * experts / topk
    local = experts / ep
    act = local * (1.0 - (1.0 - topk / experts) ** tokens) if tokens > 0 else 0.0
    i_r = inter / tp
    flops = 2.0 * 3.0 * tokens * topk / ep * hidden * i_r
    nbytes = act * 3.0 * hidden * i_r * wb + 2.0 * tokens * hidden * ACT
    return max(flops / p.rate(compute), nbytes / p.bw)


def allreduce_roof(p: Peaks, tp: float, nbytes: float) -> float:
    return 2.0 * (tp - 1) / tp * nbytes / p.link if tp > 1 else 0.0


class Calibration:
    """Measured op tables from one or more calibration files (earlier files win per family).

    Public lookups return ``(seconds, provenance)``; ``None`` when no file has the family.
    """

    def __init__(self, path: Path | list[Path], data: dict | list[dict],
                 spec: HardwareSpec | None = None):
        paths = [Path(p) for p in (path if isinstance(path, list) else [path])]
        docs = data if isinstance(data, list) else [data]
        self.path = paths[0]
        self.paths = paths
        first = docs[0]
        self.gpu = str(first.get("gpu", ""))
        self.fingerprint = first.get("fingerprint") or {}
        self.source = first.get("source") or {}
        self.peaks = Peaks(spec, first.get("peaks") or {}, str(paths[0]))
        self.label = "calibration:" + " + ".join(p.name for p in paths)
        self.tables: dict[str, dict[tuple, Table]] = {}
        self.sources: dict[str, str] = {}
        self.kernels: dict[str, list[str]] = {}
        self.files: dict[str, Path] = {}
        self.memcpy_eff: float | None = None
        self.memcpy_source: str | None = None
        self.host: dict = {}
        for p, d in zip(paths, docs):
            self._add(p, d)

    # -- parsing ---------------------------------------------------------------------------------

    def _add(self, path: Path, doc: dict) -> None:
        where = str(path)
        meta = doc.get("tables") or {}
        for fam in FAMILIES.values():
            rows = doc.get(fam.name) or []
            if fam.name in self.tables or not rows:
                continue
            if not isinstance(rows, list):
                raise ConfigError(f"{where}: {fam.name}: expected a list of rows")
            tables, kernels = self._family(fam, rows, where)
            self.tables[fam.name] = tables
            src = (meta.get(fam.name) or {}).get("source") if isinstance(meta, dict) else None
            if not src:
                measured = (doc.get("source") or {}).get("kind") == "measured"
                src = f"measured/{path.name}" if measured else path.name
            self.sources[fam.name] = str(src)
            self.kernels[fam.name] = sorted(kernels)
            self.files[fam.name] = path
        if self.memcpy_eff is None and doc.get("memcpy"):
            effs = []
            for i, r in enumerate(doc["memcpy"]):
                b = _num(r, "bytes", where, "memcpy", i)
                s = _num(r, "seconds", where, "memcpy", i)
                effs.append(min(1.0, 2 * b / self.peaks.bw / s))
            self.memcpy_eff = max(effs)  # the large-copy plateau
            self.memcpy_source = path.name
        if not self.host and doc.get("host"):
            self.host = dict(doc["host"])
            self.host_source = path.name

    def _family(self, fam: Family, rows: list, where: str) -> tuple[dict[tuple, Table], set]:
        pts: dict[tuple, dict[tuple, list[tuple[float, float]]]] = defaultdict(
            lambda: defaultdict(list))
        kernels: set[str] = set()
        for i, r in enumerate(rows):
            if not isinstance(r, dict):
                raise ConfigError(f"{where}: {fam.name}[{i}]: expected a mapping")
            cat = []
            for c in fam.cats:
                v = r.get(c, _CAT_DEFAULTS[c])
                if c == "kv_dtype" and v is None:
                    v = r.get("dtype", "bfloat16")
                cat.append(norm_dtype(v) if "dtype" in c else str(v))
            key = tuple(_num(r, k, where, fam.name, i, _KEY_DEFAULTS.get(k)) for k in fam.keys)
            xs = r.get(fam.sweep)
            ts = r.get("seconds")
            if ts is None:  # version-1 point row: the faster of Triton and vendor
                cand = [r.get(k) for k in ("triton_s", "vendor_s")]
                cand = [t for t in cand if isinstance(t, (int, float)) and t > 0]
                if not cand:
                    raise ConfigError(f"{where}: {fam.name}[{i}]: needs seconds (or triton_s/"
                                      "vendor_s)")
                ts = min(cand)
            if isinstance(xs, list) != isinstance(ts, list) or (
                    isinstance(xs, list) and len(xs) != len(ts)):
                raise ConfigError(f"{where}: {fam.name}[{i}]: '{fam.sweep}' and 'seconds' must "
                                  "both be numbers or lists of the same length")
            xs, ts = (xs, ts) if isinstance(xs, list) else ([xs], [ts])
            for j, (x, t) in enumerate(zip(xs, ts)):
                x = _val(x, f"{where}: {fam.name}[{i}].{fam.sweep}[{j}]", zero_ok=True)
                t = _val(t, f"{where}: {fam.name}[{i}].seconds[{j}]")
                if fam.name == "moe":
                    x = x * key[2] / key[3]  # tokens → tokens per expert
                pts[tuple(cat)][key].append((x, t))
            if r.get("kernel"):
                kernels.add(str(r["kernel"]))
        out = {}
        for cat, by_key in pts.items():
            roof = self._roof(fam.name, dict(zip(fam.cats, cat)))
            warp = None
            series = {}
            for key, p in by_key.items():
                if fam.name == "prefill_attention":
                    ctx = key[4]
                    warp = (lambda c, ctx=ctx: _pairs(c, ctx))
                series[key] = Series(p, warp)
            out[cat] = Table(fam.keys, fam.sweep, series, roof)
        return out, kernels

    def _roof(self, family: str, cat: dict) -> Roof:
        p = self.peaks
        if family == "gemm":
            wb, ab, comp = GEMM_DTYPES.get(cat["dtype"], (2.0, 2.0, "bf16"))
            return lambda key, m: gemm_roof(p, m, key[0], key[1], wb, ab, comp)
        if family == "decode_attention":
            kvb = KV_BYTES.get(cat["kv_dtype"], 2)
            return lambda key, x: decode_roof(p, *key, x, kvb)
        if family == "prefill_attention":
            kvb = KV_BYTES.get(cat["kv_dtype"], 2)
            return lambda key, x: prefill_roof(p, *key, x, kvb)
        if family == "allreduce":
            return lambda key, x: allreduce_roof(p, key[0], x)
        wb, _, comp = GEMM_DTYPES.get(cat["dtype"], (2.0, 2.0, "bf16"))
        return lambda key, x: moe_roof(p, *key, x, wb, comp)

    # -- provenance ------------------------------------------------------------------------------

    def provenance(self, family: str, inside: bool) -> str:
        src = self.sources.get(family, self.path.name)
        return f"calibration:{src}" if inside else f"roofline:nearest/{src}"

    def has(self, family: str) -> bool:
        return family in self.tables

    def _table(self, family: str, cat: tuple) -> Table | None:
        return self.tables.get(family, {}).get(cat)

    # -- lookups ---------------------------------------------------------------------------------

    def gemm(self, m: float, n: int, k: int, dtype: str = "bfloat16", *,
             weight_bytes: float | None = None, act_bytes: float | None = None,
             compute: str | None = None) -> tuple[float, str] | None:
        """Seconds of one GEMM (m tokens, n × k weight). A dtype without a table uses the
        nearest one that has (fp8_block → fp8 → bfloat16) scaled by the ratio of the two
        formats' rooflines; ``weight_bytes``/``act_bytes``/``compute`` describe the requested
        format when it is not a table dtype (e.g. W4A16: 0.516, 2, "bf16")."""
        fam = self.tables.get("gemm")
        if not fam:
            return None
        dtype = norm_dtype(dtype)
        wb0, ab0, c0 = GEMM_DTYPES.get(dtype, (2.0, 2.0, "bf16"))
        want = (wb0 if weight_bytes is None else weight_bytes,
                ab0 if act_bytes is None else act_bytes, c0 if compute is None else compute)
        order = [dtype] + (["fp8"] if dtype == "fp8_block" else []) + ["bfloat16"]
        cand = next((c for c in order if (c,) in fam), next(iter(fam))[0])
        sec, inside = fam[(cand,)].lookup((n, k), m)
        if cand != dtype:
            have = GEMM_DTYPES.get(cand, (2.0, 2.0, "bf16"))
            sec *= gemm_roof(self.peaks, m, n, k, *want) / gemm_roof(self.peaks, m, n, k, *have)
            inside = False
        return sec, self.provenance("gemm", inside)

    def _attn(self, family: str, kv_dtype: str) -> tuple[Table, bool] | None:
        fam = self.tables.get(family)
        if not fam:
            return None
        kv_dtype = norm_dtype(kv_dtype)
        t = fam.get((kv_dtype,))
        if t is not None:
            return t, True
        return fam.get(("bfloat16",)) or next(iter(fam.values())), False

    def decode(self, heads: int, kv_heads: int, head_dim: int, kv_dtype: str, batch: float,
               context: float) -> tuple[float, str] | None:
        """Seconds of one decode attention call: ``batch`` rows of ``context`` tokens each."""
        got = self._attn("decode_attention", kv_dtype)
        if got is None:
            return None
        t, same = got
        key = (head_dim, kv_heads, heads, batch)
        sec, inside = t.lookup(key, context)
        if not same:
            want = KV_BYTES.get(norm_dtype(kv_dtype), 2)
            have = 2 if want == 1 else 1
            sec *= decode_roof(self.peaks, *key, context, want) / decode_roof(
                self.peaks, *key, context, have)
            inside = False
        return sec, self.provenance("decode_attention", inside)

    def prefill(self, heads: int, kv_heads: int, head_dim: int, kv_dtype: str, chunk: float,
                context: float) -> tuple[float, str] | None:
        """Seconds of one sequence's prefill chunk of ``chunk`` tokens after ``context`` cached
        ones. Tables measured without a cached prefix (aiconfigurator: context 0) give the
        full-length causal kernel ``T(context + chunk)``; the chunk does the fraction
        ``pairs(chunk, context) / pairs(context + chunk, 0)`` of its work above the latency
        floor ``f`` (the kernel's fastest time): ``f + (T − f) · fraction``."""
        got = self._attn("prefill_attention", kv_dtype)
        if got is None:
            return None
        t, same = got
        has_ctx = t.axes[4][-1] > 0
        if context <= 0 or has_ctx:
            key = (head_dim, kv_heads, heads, 1, context)
            sec, inside = t.lookup(key, chunk)
        else:
            key = (head_dim, kv_heads, heads, 1, 0)
            full, inside = t.lookup(key, context + chunk)
            f = self.prefill_floor(t, key)
            sec = f + max(0.0, full - f) * _pairs(chunk, context) / _pairs(context + chunk, 0)
        if not same:
            want = KV_BYTES.get(norm_dtype(kv_dtype), 2)
            have = 2 if want == 1 else 1
            sec *= prefill_roof(self.peaks, head_dim, kv_heads, heads, 1, context, chunk,
                                want) / prefill_roof(self.peaks, head_dim, kv_heads, heads, 1,
                                                     context, chunk, have)
            inside = False
        return sec, self.provenance("prefill_attention", inside)

    @staticmethod
    def prefill_floor(t: Table, key: tuple) -> float:
        """Fastest measured time of the prefill curve ``key`` (or its interpolation at the
        smallest chunk): the kernel's latency floor."""
        s = t.series.get(key)
        if s is not None:
            return s.tmin
        return t.lookup(key, 1)[0]

    def attention_floor(self, heads: int, kv_heads: int, head_dim: int,
                        kv_dtype: str) -> float:
        """Smallest measured attention time for this head layout (decode at batch 1, the
        shortest context; else a 1-token prefill): the fixed cost of one kernel call."""
        got = self._attn("decode_attention", kv_dtype)
        if got is not None:
            return got[0].lookup((head_dim, kv_heads, heads, 1), 1)[0]
        got = self._attn("prefill_attention", kv_dtype)
        if got is not None:
            return got[0].lookup((head_dim, kv_heads, heads, 1, 0), 1)[0]
        return 0.0

    def unified_attention(self) -> bool:
        """True when decode and prefill rows run as one kernel call per layer (FlashAttention
        / Triton varlen backends); FlashInfer runs separate prefill and decode wrappers."""
        names = self.kernels.get("decode_attention", []) + self.kernels.get(
            "prefill_attention", [])
        return not any("flashinfer" in n.lower() for n in names)

    def allreduce(self, tp: int, nbytes: float, graph: bool) -> tuple[float, str] | None:
        """Seconds of one TP all-reduce of ``nbytes`` (bf16), CUDA-graph or eager."""
        fam = self.tables.get("allreduce")
        if not fam or tp <= 1:
            return None
        mode = "graph" if graph else "eager"
        t = fam.get((mode, "bfloat16")) or next(iter(fam.values()))
        sec, inside = t.lookup((tp,), nbytes)
        return sec, self.provenance("allreduce", inside)

    def moe(self, dtype: str, hidden: int, inter: int, topk: int, experts: int, tp: int,
            tokens: float, ep: int = 1) -> tuple[float, str] | None:
        """Seconds of one fused-MoE layer (routed experts) over ``tokens``, from balanced-
        routing curves (else the mildest measured skew, power_law_1.01); None when no table
        exists for ``dtype``."""
        fam = self.tables.get("moe")
        if not fam:
            return None
        dtype = norm_dtype(dtype)
        # fp8 per-tensor and block-scaled run the same fused kernels (same weight bytes)
        alts = {"fp8": ("fp8", "fp8_block"), "fp8_block": ("fp8_block", "fp8")}.get(
            dtype, (dtype,))
        for i, dt in enumerate(alts):
            t = fam.get((dt, "balanced")) or fam.get((dt, "power_law_1.01"))
            if t is not None:
                sec, inside = t.lookup((hidden, inter, topk, experts, tp, ep),
                                       tokens * topk / experts)
                return sec, self.provenance("moe", inside and i == 0)
        return None

    # -- staleness -------------------------------------------------------------------------------

    def age_days(self, now: _dt.datetime | None = None) -> float | None:
        """Days since the first file's fingerprint date (None without one)."""
        return age_days(self.fingerprint, now)


def age_days(fingerprint: dict | None, now: _dt.datetime | None = None) -> float | None:
    """Days since ``fingerprint['date']`` (None when absent or unparsable)."""
    d = (fingerprint or {}).get("date")
    if d is None:
        return None
    if isinstance(d, _dt.datetime):
        when = d
    elif isinstance(d, _dt.date):
        when = _dt.datetime(d.year, d.month, d.day)
    else:
        try:
            when = _dt.datetime.fromisoformat(str(d))
        except ValueError:
            return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.UTC)
    now = now or _dt.datetime.now(_dt.UTC)
    return (now - when).total_seconds() / 86400.0


def _val(v, where: str, zero_ok: bool = False) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (v == 0 and
                                                                           not zero_ok):
        raise ConfigError(f"{where} must be a positive number, got {v!r}")
    return float(v)


def _num(row: dict, key: str, where: str, sect: str, i: int, default=None) -> float:
    v = row.get(key, default)
    zero_ok = key == "context"
    return _val(v, f"{where}: {sect}[{i}].{key}", zero_ok)


# ---------------------------------------------------------------------------------------------
# files


def user_calibration_dir() -> Path:
    """Where ``simulate calibrate`` writes a GPU's own measurements and ``auto`` looks first:
    ``$SERVESIM_CALIBRATION_DIR``, else ``$XDG_CONFIG_HOME/servesim/calibration`` (default
    ``~/.config/servesim/calibration``)."""
    env = os.environ.get("SERVESIM_CALIBRATION_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "servesim" / "calibration"


def calibration_paths(hw_cfg: HardwareConfig, spec: HardwareSpec) -> list[Path]:
    """Files ``hardware.calibration`` selects, highest precedence first ([]: defaults).
    ``auto``: the user's measured file, then the shipped one (those that exist)."""
    sel = (hw_cfg.calibration or "auto").strip()
    if sel.lower() == "none":
        return []
    if sel.lower() == "auto":
        found = []
        for d in (user_calibration_dir(), configs_dir() / "calibration"):
            p = next((d / f"{spec.name}{ext}" for ext in (".yaml", ".json")
                      if (d / f"{spec.name}{ext}").is_file()), None)
            if p is not None:
                found.append(p)
        return found
    return [Path(sel).expanduser()]


def calibration_path(hw_cfg: HardwareConfig, spec: HardwareSpec) -> Path | None:
    """The highest-precedence file ``hardware.calibration`` selects (None: defaults)."""
    paths = calibration_paths(hw_cfg, spec)
    return paths[0] if paths else None


_doc_cache: dict[tuple, dict] = {}
_cal_cache: dict[tuple, Calibration] = {}


def read_doc(path: Path, cached: bool = True) -> dict:
    """Parsed calibration file, YAML or (``.json``, ~40x faster to load) JSON; ConfigError on
    bad input. ``cached``: shared (do not mutate) per path, size and mtime."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    doc = _doc_cache.get(key) if cached else None
    if doc is None:
        doc = _read_mapping(path, "calibration")
        if cached:
            _doc_cache[key] = doc
    return doc


def open_calibration(paths: list[Path], spec: HardwareSpec | None) -> Calibration:
    """:class:`Calibration` over ``paths`` (cached per file versions and GPU spec)."""
    stamps = tuple((str(p.resolve()), p.stat().st_mtime_ns, p.stat().st_size) for p in paths)
    key = (stamps, spec)
    cal = _cal_cache.get(key)
    if cal is None:
        cal = Calibration(list(paths), [read_doc(p) for p in paths], spec)
        _cal_cache[key] = cal
    return cal


def load_calibration(hw_cfg: HardwareConfig, spec: HardwareSpec) -> Calibration | None:
    """Load the calibration the ``hardware`` section selects, warning (one line) when no file
    exists for this GPU, a measured file is stale (> 180 days) or made for another GPU."""
    sel = (hw_cfg.calibration or "auto").strip().lower()
    if sel == "none":
        return None
    paths = calibration_paths(hw_cfg, spec)
    if sel != "auto" and not paths[0].is_file():
        raise ConfigError(f"hardware.calibration: no such calibration file {paths[0]}")
    if not paths:
        _warn(f"no calibration file configs/calibration/{spec.name}.yaml (or .json) for "
              f"{spec.name}: "
              "using default efficiencies (provenance 'roofline:default'); run `simulate "
              "calibrate` on that GPU")
        return None
    cal = open_calibration(paths, spec)
    for p in paths:
        doc = read_doc(p)
        gpu = str(doc.get("gpu", ""))
        if gpu and gpu != spec.name:
            _warn(f"{p}: calibrated on '{gpu}' but hardware is '{spec.name}'")
        if (doc.get("source") or {}).get("kind") == "aiconfigurator":
            continue  # imported tables carry their package and vLLM versions, not a date
        age = age_days(doc.get("fingerprint"))
        if age is not None and age > STALE_DAYS:
            _warn(f"{p}: calibration fingerprint is {age:.0f} days old (> {STALE_DAYS}); "
                  "re-run `simulate calibrate`")
    return cal


# ---------------------------------------------------------------------------------------------
# fit report (`simulate calibrate check`)


def _stat(xs: list[float]) -> tuple[float, float]:
    """(median, P90) of ``xs`` (nearest-rank P90)."""
    s = sorted(xs)
    n = len(s)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    p90 = s[min(n - 1, math.ceil(0.9 * n) - 1)]
    return med, p90


def check(cal: Calibration) -> dict[str, dict]:
    """Per family, how well the cost model's lookups reproduce the file's own rows.

    ``at_rows``: |lookup − measured| / measured at every measured point (0 unless rows
    disagree, e.g. duplicate points). ``loo``: the same with each point left out of its curve,
    i.e. predicted from its neighbours along the swept coordinate (the ends by roofline × the
    neighbour's efficiency): the interpolation error between measured points.
    """
    out = {}
    for fam, tables in cal.tables.items():
        at, loo = [], []
        for t in tables.values():
            for key, s in t.series.items():
                for i, (x, meas) in enumerate(zip(s.xs, s.ts)):
                    at.append(abs(t.lookup(key, x)[0] - meas) / meas)
                    pred = t.loo(key, i)
                    if pred is not None:
                        loo.append(abs(pred - meas) / meas)
        if at:
            am, ap = _stat(at)
            lm, lp = _stat(loo) if loo else (math.nan, math.nan)
            out[fam] = {"points": len(at), "curves": sum(len(t.series) for t in tables.values()),
                        "median_abs_err": am, "p90_abs_err": ap,
                        "loo_median_abs_err": lm, "loo_p90_abs_err": lp,
                        "source": cal.sources.get(fam), "kernels": cal.kernels.get(fam, [])}
    return out


__all__ = [
    "FAMILIES",
    "Calibration",
    "CalibrationWarning",
    "Series",
    "Table",
    "calibration_path",
    "calibration_paths",
    "check",
    "load_calibration",
    "norm_dtype",
    "open_calibration",
    "read_doc",
    "user_calibration_dir",
]
