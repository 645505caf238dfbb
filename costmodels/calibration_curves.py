"""Measured curves and lookups in them: interpolation inside the grid, the roofline outside,
and how well that reproduces a file's own rows (``simulate calibrate check``).

A :class:`Table` holds one op family's curves for one categorical combination (e.g. GEMM in
fp8), keyed by numeric coordinates (e.g. ``(n, k)``); each :class:`Series` runs over the swept
coordinate (e.g. ``m``). :meth:`Table.lookup`:

- **inside** the measured grid: multilinear interpolation of *time* in the raw coordinates
  (exact at table points; exact for ``t = floor + a·x`` kernels between points). Prefill chunks
  interpolate in causal (query, key) pairs ``chunk·context + chunk(chunk+1)/2``; MoE curves run
  over tokens per expert ``tokens·topk/experts``.
- **outside** (beyond a curve's range, a key not measured, a grid corner missing): the
  roofline of the requested shape times the nearest measured point's ``time / roofline``
  (its efficiency), never below that curve's fastest time (the kernel's latency floor).

Units: seconds; coordinates as in the file (tokens, bytes, heads).
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servesim.costmodels.calibration_tables import Calibration


def _l(x: float) -> float:
    return math.log1p(max(x, 0.0))



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
        self._memo: dict[tuple, tuple[float, bool]] = {}  # (key, x) -> lookup (hot path)

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
        """(seconds, inside) at ``key`` and swept coordinate ``x`` (memoised: the simulator
        asks for the same points step after step)."""
        got = self._memo.get((key, x))
        if got is None:
            if len(self._memo) >= 1 << 18:
                self._memo.clear()
            got = self._memo[(key, x)] = self._lookup(key, x)
        return got

    def _lookup(self, key: tuple, x: float) -> tuple[float, bool]:
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



def _stat(xs: list[float]) -> tuple[float, float]:
    """(median, P90) of ``xs`` (nearest-rank P90)."""
    s = sorted(xs)
    return statistics.median(s), s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]


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

