"""The power cap under sustained compute: a busy GPU's compute-bound kernels run slower than
the burst timings the step cost model charges.

Kernel tables (aiconfigurator's, ``simulate calibrate``'s) time kernels in short runs, at
most ~30 ms of one shape at a time, before the cap has bitten (boost clocks). Run
compute-bound work back to back and an H100 or H200 reaches its 700 W cap, and the SM clock
drops from 1,980 to about 1,350 MHz
(``benchmarks/data/gpu_checks_<gpu>.json``, sections ``sustained`` and ``duty``; summary in
``configs/calibration/README.md``). The slowdown of compute-bound work depends on the share of
the GPU's time spent in it over the last ~100 ms. It is nothing below a threshold and about
1.2x at 100%; memory-bound work is unaffected.

:class:`SustainedClock` follows that share per engine (one GPU, or a TP group loaded alike):

- ``u``: the compute share, an exponential average with time constant ``τ`` s
  (``HardwareSpec.power_cap_tau_s``). A step of ``dt`` s with ``c`` s of compute-bound work
  contributes share ``d = c / dt``; idle time contributes 0. One ``τ`` both ways, because the
  measured slowdown follows the share averaged over cycles shorter than ``τ``. It
  over-charges the first ~70 ms of load after idle, where the cap has not bitten yet.
- The step's mean share is ``ū = d + (u₀ − d)·(τ/b)·(1 − e^(−b/τ))``, where ``u₀`` is the
  share when the step starts and ``b`` the time the step holds the GPU (``dt``; ``dt / pp``
  for one stage of ``pp``). The step leaves the share its slowed compute time over its
  slowed time, averaged over how long the slowed step holds the GPU.
- The step's compute-bound work is charged ``c·(F(ū) − 1)`` s more. ``F`` interpolates the
  measured (share, factor) points of ``HardwareSpec.power_cap_curve``, from (0, 1), and is
  flat past its last point.

GPUs without a measured curve are charged burst times (no wrapper).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from servesim.costmodels.batch import BatchShape


def _points(hw) -> tuple[tuple[float, float], ...]:
    """``hw``'s measured (share, factor) points, from (0, 1)."""
    return ((0.0, 1.0),) + tuple(hw.power_cap_curve)


def _factor(pts: tuple[tuple[float, float], ...], share: float) -> float:
    """The measured points ``pts`` (from (0, 1)) interpolated at ``share``, flat past the last."""
    if share >= pts[-1][0]:
        return pts[-1][1]
    for (a, fa), (b, fb) in itertools.pairwise(pts):
        if share <= b:
            return fa + (fb - fa) * (share - a) / (b - a)
    return pts[-1][1]


class SustainedClock:
    """``step_seconds`` / ``decode_seconds`` of a cost model with the power cap's slowdown,
    for one engine whose steps run back to back on the GPU timeline (``now()``: the
    simulation clock; a step starts when both the engine asks and the GPU is free). With
    pipeline parallelism (``pp`` stages) a batch holds each stage's GPU for 1/pp of its
    latency, the part of the timeline it takes. A step whose time was asked for but which did
    not run (the engine waits for an event first) is taken back with :meth:`undo`."""

    def __init__(self, cost, now: Callable[[], float]):
        spec = cost.hw
        self.cost = cost
        self.now = now
        self.tau = spec.power_cap_tau_s
        self.stages = max(1, int(getattr(cost, "pp", 1) or 1))
        self.points = _points(spec)
        self.u = 0.0  # compute share when the GPU last became free
        self.free = 0.0  # when the GPU's last step ends (s)
        self._shape = BatchShape()
        self._decode_compute: dict[int, float] = {}  # rows -> compute-bound seconds
        self.extra_seconds = 0.0  # GPU-busy seconds the slowdown added (like busy_seconds)
        self._before: tuple[float, float, float] | None = None  # (u, free, extra) for undo

    def factor(self, share: float) -> float:
        """``F(share)``: the time factor of compute-bound work at this compute share."""
        return _factor(self.points, share)

    def step_seconds(self, batch: BatchShape) -> float:
        """:meth:`StepCostModel.step_seconds` plus the slowdown of its compute-bound work."""
        return self._charge(self.cost.step_seconds(batch), self.cost.compute_seconds(batch))

    def decode_seconds(self, nd: int, ctx_sum: int) -> float:
        """:meth:`StepCostModel.decode_step_seconds` plus the slowdown, as for the same batch
        through :meth:`step_seconds` (a decode batch's compute-bound seconds depend on its
        rows only: the dense ops at its padded size)."""
        c = self._decode_compute.get(nd)
        if c is None:
            shape = self._shape
            shape.num_decode = shape.num_sampled = nd
            shape.decode_context_sum = ctx_sum
            c = self._decode_compute[nd] = self.cost.compute_seconds(shape)
        return self._charge(self.cost.decode_step_seconds(nd, ctx_sum), c)

    def undo(self) -> None:
        """Take back the last step charged (it did not run)."""
        if self._before is not None:
            self.u, self.free, self.extra_seconds = self._before
            self._before = None

    def _charge(self, dt: float, c: float) -> float:
        self._before = (self.u, self.free, self.extra_seconds)
        now = self.now()
        free = self.free
        start = now if now > free else free
        u = self.u
        if start > free:  # idle since the last step: the share decays
            u *= math.exp(-(start - free) / self.tau)
        busy = dt / self.stages  # this GPU's share of the step (its pipeline stage)
        if c <= 0.0 or dt <= 0.0:
            self.u = u * math.exp(-busy / self.tau) if dt > 0.0 else u
            self.free = start + busy
            return dt
        d = c / dt
        tau = self.tau
        mean = d + (u - d) * tau / busy * (1.0 - math.exp(-busy / tau))
        extra = c * (self.factor(mean) - 1.0)
        self.extra_seconds += extra / self.stages
        # the share the step leaves: its slowed compute over its slowed time, for as long
        # as the slowed step holds the GPU
        dt += extra
        busy = dt / self.stages
        d = (c + extra) / dt
        self.u = d + (u - d) * math.exp(-busy / tau)
        self.free = start + busy
        return dt


def sustained_step_seconds(cost, batch: BatchShape) -> float | None:
    """Seconds of ``batch`` when the engine runs it back to back (``simulate estimate``),
    or None for a GPU without a measured curve. At the steady state the share is the step's
    own slowed share ``u = (c + x) / (dt + x)`` and the extra ``x = c·(F(u) − 1)``: their
    fixed point, by iteration from ``u = c / dt``."""
    if not cost.hw.power_cap_curve:
        return None
    pts = _points(cost.hw)
    dt, c = cost.step_seconds(batch), cost.compute_seconds(batch)
    if c <= 0 or dt <= 0:
        return dt
    x = 0.0
    for _ in range(50):
        x = c * (_factor(pts, (c + x) / (dt + x)) - 1.0)
    return dt + x


def sustained_clock(cost, now: Callable[[], float]) -> SustainedClock | None:
    """A :class:`SustainedClock` for ``cost``'s GPU, or None without a measured curve."""
    return SustainedClock(cost, now) if cost.hw.power_cap_curve else None
