"""Calibration reader: ``configs/calibration/<hardware-name>.yaml`` → efficiency lookups.

Schema: DEVELOPERS.md ("Calibration file"). For every measured row the efficiency is

    eff = roofline_seconds(flops, bytes, peaks) / measured_seconds        (dimensionless, ≤ 1)

with ``roofline_seconds = max(flops / peak_flops, bytes / mem_bw)`` from the file's ``peaks``
and ``measured_seconds`` the faster of ``triton_s`` and ``vendor_s``. The cost model then times
an operator as ``roofline_seconds(op) / eff(shape)``. Lookups interpolate:

- GEMM: per (n, k), linear in log(m); the nearest (n, k) in log distance when not measured.
- decode attention: bilinear in (log batch, log context); nearest row otherwise.
- prefill attention: bilinear in (log chunk, log context + 1); nearest row otherwise.
- memcpy: bandwidth efficiency for elementwise ops (a copy moves 2·bytes: read + write).
- optional ``host:`` section: :class:`~servesim.costmodels.step.HostOverhead` coefficients
  (fitted from a real run, e.g. ``vllm bench serve``).

Out-of-range shapes clamp to the nearest measured efficiency (no extrapolation).
"""

from __future__ import annotations

import bisect
import datetime as _dt
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from servesim.costmodels.config import HardwareConfig
from servesim.costmodels.specs import HardwareSpec, _read_mapping, configs_dir
from servesim.simulator.errors import ConfigError

STALE_DAYS = 180
_ELEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1, "int8": 1}
_DTYPES = {
    "bf16": ("bfloat16", "float16"),
    "fp8": ("float8_e4m3fn", "float8_e4m3", "fp8", "float8"),
    "int8": ("int8",),
}


class CalibrationWarning(UserWarning):
    """A calibration file is missing for the GPU, stale, or for another GPU."""


_warned: set[str] = set()


def _warn(msg: str) -> None:
    """One-line warning, once per process per message."""
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, CalibrationWarning, stacklevel=3)


def _log(x: float) -> float:
    return math.log(max(x, 1e-9))


@dataclass
class Curve:
    """Efficiency vs one shape variable, linear in log(x), clamped at the ends."""

    xs: list[float]  # log x, sorted
    ys: list[float]

    def __call__(self, x: float) -> float:
        lx = _log(x)
        xs, ys = self.xs, self.ys
        if lx <= xs[0]:
            return ys[0]
        if lx >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, lx)
        x0, x1 = xs[i - 1], xs[i]
        t = (lx - x0) / (x1 - x0)
        return ys[i - 1] + t * (ys[i] - ys[i - 1])


@dataclass
class Table2D:
    """Efficiency over two shape variables (log space): bilinear on a grid, else nearest."""

    points: dict[tuple[float, float], float]  # (a, b) → eff, mean over duplicates
    a_vals: list[float] = field(default_factory=list)
    b_vals: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.a_vals = sorted({a for a, _ in self.points})
        self.b_vals = sorted({b for _, b in self.points})

    @staticmethod
    def _bracket(vals: list[float], x: float) -> tuple[float, float]:
        if x <= vals[0]:
            return vals[0], vals[0]
        if x >= vals[-1]:
            return vals[-1], vals[-1]
        i = bisect.bisect_right(vals, x)
        return vals[i - 1], vals[i]

    def __call__(self, a: float, b: float) -> float:
        a0, a1 = self._bracket(self.a_vals, a)
        b0, b1 = self._bracket(self.b_vals, b)
        p = self.points
        corners = [(a0, b0), (a1, b0), (a0, b1), (a1, b1)]
        if all(c in p for c in corners):
            ta = 0.0 if a1 == a0 else (_log(a) - _log(a0)) / (_log(a1) - _log(a0))
            tb = 0.0 if b1 == b0 else (_log(b) - _log(b0)) / (_log(b1) - _log(b0))
            lo = p[(a0, b0)] + ta * (p[(a1, b0)] - p[(a0, b0)])
            hi = p[(a0, b1)] + ta * (p[(a1, b1)] - p[(a0, b1)])
            return lo + tb * (hi - lo)
        la, lb = _log(a), _log(b)
        best = min(p, key=lambda k: (_log(k[0]) - la) ** 2 + (_log(k[1]) - lb) ** 2)
        return p[best]


class Calibration:
    """Efficiency tables read from one calibration file."""

    def __init__(self, path: Path, data: dict, spec: HardwareSpec | None = None):
        self.path = Path(path)
        self.label = f"calibrated:{self.path.name}"
        self.gpu = str(data.get("gpu", ""))
        self.fingerprint = data.get("fingerprint") or {}
        peaks = data.get("peaks") or {}
        where = str(self.path)

        def peak(key: str, fallback: float | None) -> float | None:
            v = peaks.get(key, fallback)
            return float(v) if v else None

        self.bf16 = peak("bf16_tflops", spec.bf16_tflops if spec else None)
        self.fp8 = peak("fp8_tflops", spec.fp8_tflops if spec else None)
        self.int8 = peak("int8_tops", spec.int8_tops if spec else None)
        self.bw = peak("mem_bw_gbps", spec.mem_bw_gbps if spec else None)
        if not self.bf16 or not self.bw:
            raise ConfigError(f"{where}: peaks.bf16_tflops and peaks.mem_bw_gbps are required")

        self.memcpy_eff: float | None = None
        rows = data.get("memcpy") or []
        effs = []
        for i, r in enumerate(rows):
            b, s = self._num(r, "bytes", where, "memcpy", i), self._num(r, "seconds", where,
                                                                         "memcpy", i)
            effs.append(min(1.0, 2 * b / (self.bw * 1e9) / s))
        if effs:
            self.memcpy_eff = max(effs)  # the large-copy plateau

        # GEMM: per dtype group → per (n, k) → Curve over m
        gem: dict[str, dict[tuple[int, int], list[tuple[float, float]]]] = defaultdict(
            lambda: defaultdict(list))
        for i, r in enumerate(data.get("gemm") or []):
            m, n, k = (int(self._num(r, x, where, "gemm", i)) for x in ("m", "n", "k"))
            dt = str(r.get("dtype", "bfloat16"))
            elem = _ELEM.get(dt, 2)
            flops = float(r.get("flops") or 2.0 * m * n * k)
            nbytes = float(r.get("bytes") or (m * k + k * n + m * n) * elem)
            eff = self._eff(r, flops, nbytes, self._peak_for(dt), where, "gemm", i)
            gem[self._group(dt)][(n, k)].append((float(m), eff))
        self.gemm: dict[str, dict[tuple[int, int], Curve]] = {}
        for g, by_nk in gem.items():
            self.gemm[g] = {}
            for nk, pts in by_nk.items():
                agg: dict[float, list[float]] = defaultdict(list)
                for m, e in pts:
                    agg[m].append(e)
                ms = sorted(agg)
                self.gemm[g][nk] = Curve([_log(m) for m in ms],
                                         [sum(agg[m]) / len(agg[m]) for m in ms])

        self.decode = self._table(data.get("decode_attention") or [], "batch", "context",
                                  where, "decode_attention")
        self.prefill = self._table(data.get("prefill_attention") or [], "chunk", "context",
                                   where, "prefill_attention", b_offset=1)
        self.host = data.get("host") or {}
        self._nk_cache: dict[tuple[str, int, int], Curve | None] = {}

    # -- parsing helpers -------------------------------------------------------------------------

    @staticmethod
    def _num(row: dict, key: str, where: str, sect: str, i: int) -> float:
        v = row.get(key) if isinstance(row, dict) else None
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            if key == "context" and v == 0:
                return 0.0
            raise ConfigError(f"{where}: {sect}[{i}].{key} must be a positive number, got {v!r}")
        return float(v)

    @staticmethod
    def _group(dtype: str) -> str:
        for g, names in _DTYPES.items():
            if dtype in names:
                return g
        return "bf16"

    def _peak_for(self, dtype: str) -> float:
        g = self._group(dtype)
        tf = {"fp8": self.fp8, "int8": self.int8}.get(g) or self.bf16
        return tf * 1e12

    def _eff(self, row: dict, flops: float, nbytes: float, peak: float, where: str, sect: str,
             i: int) -> float:
        times = [row.get(k) for k in ("triton_s", "vendor_s")]
        times = [float(t) for t in times if isinstance(t, (int, float)) and t > 0]
        if not times:
            raise ConfigError(f"{where}: {sect}[{i}]: needs triton_s or vendor_s (seconds)")
        roof = max(flops / peak, nbytes / (self.bw * 1e9))
        return min(1.0, roof / min(times))

    def _table(self, rows: list, a_key: str, b_key: str, where: str, sect: str,
               b_offset: int = 0) -> Table2D | None:
        pts: dict[tuple[float, float], list[float]] = defaultdict(list)
        for i, r in enumerate(rows):
            a = self._num(r, a_key, where, sect, i)
            b = self._num(r, b_key, where, sect, i) + b_offset
            dt = str(r.get("dtype", "bfloat16"))
            flops = self._num(r, "flops", where, sect, i)
            nbytes = self._num(r, "bytes", where, sect, i)
            pts[(a, b)].append(self._eff(r, flops, nbytes, self._peak_for(dt), where, sect, i))
        if not pts:
            return None
        return Table2D({k: sum(v) / len(v) for k, v in pts.items()})

    # -- lookups ---------------------------------------------------------------------------------

    def _curve(self, compute: str, n: int, k: int) -> Curve | None:
        key = (compute, n, k)
        if key not in self._nk_cache:
            groups = self.gemm.get(compute) or self.gemm.get("bf16") or next(
                iter(self.gemm.values()), None)
            if not groups:
                self._nk_cache[key] = None
            elif (n, k) in groups:
                self._nk_cache[key] = groups[(n, k)]
            else:
                ln, lk = _log(n), _log(k)
                best = min(groups, key=lambda nk: abs(_log(nk[0]) - ln) + abs(_log(nk[1]) - lk))
                self._nk_cache[key] = groups[best]
        return self._nk_cache[key]

    def gemm_eff(self, m: float, n: int, k: int, compute: str = "bf16") -> float | None:
        """GEMM efficiency at (m, n, k), or None when the file has no GEMM rows."""
        c = self._curve(compute, n, k)
        return None if c is None else c(m)

    def decode_eff(self, batch: float, context: float) -> float | None:
        return None if self.decode is None else self.decode(batch, context)

    def prefill_eff(self, chunk: float, context: float) -> float | None:
        return None if self.prefill is None else self.prefill(chunk, context + 1)

    # -- staleness -------------------------------------------------------------------------------

    def age_days(self, now: _dt.datetime | None = None) -> float | None:
        d = self.fingerprint.get("date")
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


def calibration_path(hw_cfg: HardwareConfig, spec: HardwareSpec) -> Path | None:
    """Which file ``hardware.calibration`` selects (None: defaults)."""
    sel = (hw_cfg.calibration or "auto").strip()
    if sel.lower() == "none":
        return None
    if sel.lower() == "auto":
        return configs_dir() / "calibration" / f"{spec.name}.yaml"
    return Path(sel).expanduser()


def load_calibration(hw_cfg: HardwareConfig, spec: HardwareSpec) -> Calibration | None:
    """Load the calibration the ``hardware`` section selects, warning (one line) when the
    file is missing for this GPU, stale (> 180 days) or made for another GPU."""
    path = calibration_path(hw_cfg, spec)
    if path is None:
        return None
    auto = (hw_cfg.calibration or "auto").strip().lower() == "auto"
    if not path.is_file():
        if auto:
            _warn(f"no calibration file configs/calibration/{spec.name}.yaml for {spec.name}: "
                  "using default efficiencies (provenance 'default'); run `simulate calibrate` "
                  "on that GPU")
            return None
        raise ConfigError(f"hardware.calibration: no such calibration file {path}")
    data = _read_mapping(path, "calibration")
    cal = Calibration(path, data, spec)
    if cal.gpu and cal.gpu != spec.name:
        _warn(f"{path}: calibrated on '{cal.gpu}' but hardware is '{spec.name}'")
    age = cal.age_days()
    if age is not None and age > STALE_DAYS:
        _warn(f"{path}: calibration fingerprint is {age:.0f} days old (> {STALE_DAYS}); "
              "re-run `simulate calibrate`")
    return cal
