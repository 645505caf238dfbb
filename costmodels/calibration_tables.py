"""``Calibration``: a calibration file's rows as lookup tables per op family, the cost model's
per-op queries, and the provenance of each answer.

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
version-1 rows with ``triton_s``/``vendor_s`` take the faster of the two). Lookups interpolate
or fall back to the roofline (``calibration_curves``); a query for a dtype without a table
scales the nearest table by the ratio of the two formats' rooflines (``calibration_roofline``).
Provenance reads ``calibration:<source>`` inside the measured grid and
``roofline:nearest/<source>`` outside it.

Files are layered per family, earlier first, with one exception: an attention or MoE family
measured only on servesim's stand-ins for vLLM's kernels (its Triton kernels, SDPA, the torch
MoE reference: ``simulate calibrate`` without vLLM installed) yields to a later file's family
measured on vLLM's own kernels (an imported aiconfigurator table, or ``simulate calibrate``
with vLLM). On Hopper, SDPA runs FA2 for a chunk after cached tokens, about half the speed
of the FA3 vLLM runs there.
"""

from __future__ import annotations

import datetime as _dt
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from servesim.costmodels.calibration_curves import Roof, Series, Table
from servesim.costmodels.calibration_roofline import (
    KV_BYTES,
    Peaks,
    allreduce_roof,
    causal_pairs,
    decode_roof,
    gemm_format,
    gemm_roof,
    moe_roof,
    norm_dtype,
    prefill_roof,
)
from servesim.costmodels.specs import HardwareSpec
from servesim.simulator.errors import ConfigError


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


# kernel names ``simulate calibrate`` gives its stand-ins for vLLM's kernels, and the families
# where a stand-in is another kernel than vLLM's (GEMMs: cuBLAS is what vLLM runs for bf16)
STAND_IN_KERNELS = ("triton", "sdpa(", "torch reference")
YIELDING_FAMILIES = ("decode_attention", "prefill_attention", "moe")


def _stand_ins(family: str, kernels: list[str] | set[str]) -> bool:
    """Whether a family's rows were all measured on stand-ins for vLLM's kernels."""
    return family in YIELDING_FAMILIES and bool(kernels) and all(
        str(k).startswith(STAND_IN_KERNELS) for k in kernels)


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
        self.memcpy_eff: float | None = None
        self.memcpy_source: str | None = None
        self.host: dict = {}
        self.frontend: dict = {}  # API-server costs (simulator/frontend.py), like ``host``
        self.frontend_source = ""
        self.scales: dict = {}  # op family -> time factor (simulate fit --scales)
        self.scales_tables: dict | None = None  # family -> source the scales were fitted on
        self.scales_path = ""
        self.yielded: dict[str, str] = {}  # family -> source of stand-in rows it replaced
        for p, d in zip(paths, docs):
            self._add(p, d)

    # -- parsing ---------------------------------------------------------------------------------

    def _add(self, path: Path, doc: dict) -> None:
        where = str(path)
        meta = doc.get("tables") or {}
        for fam in FAMILIES.values():
            rows = doc.get(fam.name) or []
            taken = fam.name in self.tables
            if not rows or (taken and not _stand_ins(fam.name, self.kernels[fam.name])):
                continue
            if not isinstance(rows, list):
                raise ConfigError(f"{where}: {fam.name}: expected a list of rows")
            tables, kernels = self._family(fam, rows, where)
            if taken:
                if not kernels or _stand_ins(fam.name, kernels):
                    continue  # (only vLLM's kernels replace stand-ins)
                self.yielded[fam.name] = self.sources[fam.name]
            self.tables[fam.name] = tables
            src = (meta.get(fam.name) or {}).get("source") if isinstance(meta, dict) else None
            if not src:
                measured = (doc.get("source") or {}).get("kind") == "measured"
                src = f"measured/{path.name}" if measured else path.name
            self.sources[fam.name] = str(src)
            self.kernels[fam.name] = sorted(kernels)
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
        if not self.scales and doc.get("scales"):
            sc = doc["scales"]
            if not isinstance(sc, dict) or not all(
                    isinstance(v, (int, float)) and v > 0 for v in sc.values()):
                raise ConfigError(f"{where}: scales: expected op family: positive factor")
            self.scales = {str(k): float(v) for k, v in sc.items()}
            fit = doc.get("fit")
            self.scales_tables = fit.get("tables") if isinstance(fit, dict) else None
            self.scales_path = where
        if not self.frontend and doc.get("frontend"):
            if not isinstance(doc["frontend"], dict):
                raise ConfigError(f"{where}: frontend: expected a mapping of parameters")
            self.frontend = dict(doc["frontend"])
            self.frontend_source = path.name

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
                    warp = (lambda c, ctx=ctx: causal_pairs(c, ctx))
                series[key] = Series(p, warp)
            out[cat] = Table(fam.keys, fam.sweep, series, roof)
        return out, kernels

    def _roof(self, family: str, cat: dict) -> Roof:
        p = self.peaks
        if family == "gemm":
            wb, ab, comp = gemm_format(cat["dtype"])
            return lambda key, m: gemm_roof(p, m, key[0], key[1], wb, ab, comp)
        if family == "decode_attention":
            kvb = KV_BYTES.get(cat["kv_dtype"], 2)
            return lambda key, x: decode_roof(p, *key, x, kvb)
        if family == "prefill_attention":
            kvb = KV_BYTES.get(cat["kv_dtype"], 2)
            return lambda key, x: prefill_roof(p, *key, x, kvb)
        if family == "allreduce":
            return lambda key, x: allreduce_roof(p, key[0], x)
        wb, _, comp = gemm_format(cat["dtype"])
        return lambda key, x: moe_roof(p, *key, x, wb, comp)

    # -- provenance ------------------------------------------------------------------------------

    def provenance(self, family: str, inside: bool) -> str:
        memo = self.__dict__.setdefault("_provenance", {})  # (the simulator's hot path)
        got = memo.get((family, inside))
        if got is None:
            src = self.sources.get(family, self.path.name)
            got = memo[(family, inside)] = (f"calibration:{src}" if inside
                                            else f"roofline:nearest/{src}")
        return got

    def has(self, family: str) -> bool:
        return family in self.tables

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
        wb0, ab0, c0 = gemm_format(dtype)
        want = (wb0 if weight_bytes is None else weight_bytes,
                ab0 if act_bytes is None else act_bytes, c0 if compute is None else compute)
        order = [dtype] + (["fp8"] if dtype == "fp8_block" else []) + ["bfloat16"]
        cand = next((c for c in order if (c,) in fam), next(iter(fam))[0])
        sec, inside = fam[(cand,)].lookup((n, k), m)
        if cand != dtype:
            have = gemm_format(cand)
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
            sec *= _kv_scale(kv_dtype, lambda kvb: decode_roof(self.peaks, *key, context, kvb))
            inside = False
        return sec, self.provenance("decode_attention", inside)

    def prefill(self, heads: int, kv_heads: int, head_dim: int, kv_dtype: str, chunk: float,
                context: float) -> tuple[float, str] | None:
        """Seconds of one sequence's prefill chunk of ``chunk`` tokens after ``context`` cached
        ones. Tables measured without a cached prefix (aiconfigurator: context 0) give the
        full-length causal kernel ``T(context + chunk)``; the chunk does the fraction
        ``pairs(chunk, context) / pairs(context + chunk, 0)`` of its work above the latency
        floor ``f`` (the kernel's fastest time): ``f + (T − f) · fraction``."""
        fn = self.prefill_fn(heads, kv_heads, head_dim, kv_dtype)
        return None if fn is None else fn(chunk, context)

    def prefill_fn(self, heads: int, kv_heads: int, head_dim: int, kv_dtype: str):
        """:meth:`prefill` for one head layout as a function of (chunk, context), the
        layout's table, floor and provenance looked up once (the simulator's hot path: a new
        (chunk, context) point at almost every prefill chunk); None without a table."""
        got = self._attn("prefill_attention", kv_dtype)
        if got is None:
            return None
        t, same = got
        has_ctx = t.axes[4][-1] > 0
        lookup = t.lookup
        prov = {ok: self.provenance("prefill_attention", ok) for ok in (True, False)}
        key0 = (head_dim, kv_heads, heads, 1, 0)
        f = 0.0 if has_ctx else self.prefill_floor(t, key0)
        peaks = self.peaks

        def prefill(chunk: float, context: float) -> tuple[float, str]:
            if context <= 0 or has_ctx:
                sec, inside = lookup((head_dim, kv_heads, heads, 1, context), chunk)
            else:
                full, inside = lookup(key0, context + chunk)
                sec = f + max(0.0, full - f) * causal_pairs(chunk, context) / causal_pairs(
                    context + chunk, 0)
            if not same:  # scaled from another KV dtype's table
                sec *= _kv_scale(kv_dtype, lambda kvb: prefill_roof(
                    peaks, head_dim, kv_heads, heads, 1, context, chunk, kvb))
                inside = False
            return sec, prov[inside]
        return prefill

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


def _kv_scale(kv_dtype: str, roof: Callable[[float], float]) -> float:
    """Roofline ratio of the requested KV-cache dtype to the other one (the table's, when the
    requested one has no table): ``roof(kv bytes wanted) / roof(kv bytes had)``."""
    want = KV_BYTES.get(norm_dtype(kv_dtype), 2)
    return roof(want) / roof(2 if want == 1 else 1)


def _val(v, where: str, zero_ok: bool = False) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (v == 0 and
                                                                           not zero_ok):
        raise ConfigError(f"{where} must be a positive number, got {v!r}")
    return float(v)


def _num(row: dict, key: str, where: str, sect: str, i: int, default=None) -> float:
    v = row.get(key, default)
    zero_ok = key == "context"
    return _val(v, f"{where}: {sect}[{i}].{key}", zero_ok)
