"""The bounded least-squares search behind ``simulate fit`` (:mod:`servesim.simulator.fit`).

Staged coordinate sweeps over log grids (:func:`search`), then a wide-difference
Gauss–Newton polish with jumps along the valley floor (:func:`polish`): a cost that is a
staircase of the parameters (simulated latencies are step functions of them) with a downhill
trend and valleys where parameters trade off. Works on plain coordinate vectors with a
``cost``/``residuals`` pair; the problem itself (parameters, priors, runs) lives in ``fit.py``.
"""

from __future__ import annotations

import math

import numpy as np

# Search stages: coordinate groups swept in turn (with the residuals that see them best),
# then all together. Host terms first, on TPOT alone (every engine step carries them); then
# what a lightly loaded run sees (the frontend's total delay, tokenization per prompt token);
# then how the total splits (request work vs IPC vs output work: seen through queueing).
WIDE_RADII = (0.3, 0.2, 0.12, 0.08, 0.05, 0.03)  # wide Gauss–Newton radii (log units)
STAGES = (
    (("per_step_s", "per_request_s"), ("tpot",)),
    (("frontend_total", "tokenize_per_token_s", "ipc_s", "request_s",
      "detokenize_per_token_s"), ("ttft",)),
    (("request_share", "detokenize_share"), ("ttft", "tpot")),
)


def search(cost, residuals, x0: np.ndarray, lo: np.ndarray, hi: np.ndarray,
           max_evals: int, coords: list[str]) -> tuple[np.ndarray, float]:
    """Minimise ``cost`` over the search coordinates (logs; see
    :func:`servesim.simulator.fit._coordinates`).

    Simulated latencies are step functions of the parameters (an arrival that crosses an
    engine-step boundary or a tokenizer window moves a request by a whole step), so the cost
    is a staircase with a downhill trend and narrow valleys: grids see the trend where small
    finite differences see only the steps. Stages (:data:`STAGES`): each group of
    coordinates is swept over log grids (±1 decade in 17 points, then ±0.3 decade in 9,
    repeated while they improve) on the residuals that see it; then all coordinates at once
    pairs in a group by Gauss–Newton (``least_squares``, finite differences over ±10%), and
    the host and frontend groups by :func:`_wide_newton`."""
    from scipy.optimize import least_squares

    ln10 = math.log(10)
    x = x0.copy()
    n = [0]

    def sweep(idx: list[int], span: float, pts: int, parts) -> bool:
        """One pass over coordinates ``idx``; True when it improved the cost."""
        nonlocal x
        best = cost(x, parts)
        n[0] += 1
        start = best
        for j in idx:
            for g in x[j] + np.linspace(-span, span, pts) * ln10:
                if n[0] >= max_evals:
                    return False
                g = float(np.clip(g, lo[j], hi[j]))
                if abs(g - x[j]) < 1e-12:
                    continue
                y = x.copy()
                y[j] = g
                c = cost(y, parts)
                n[0] += 1
                if c < best:
                    x, best = y, c
        return best < start * 0.98

    def newton(idx: list[int], parts, step: float, nfev: int) -> None:
        """Gauss–Newton on coordinates ``idx`` (the rest held)."""
        nonlocal x
        if nfev < 2 or n[0] >= max_evals:
            return

        def r(y):
            z = x.copy()
            z[idx] = y
            return residuals(z, parts)

        sol = least_squares(r, x[idx], bounds=(lo[idx], hi[idx]), method="trf",
                            diff_step=step, max_nfev=nfev, xtol=1e-4, ftol=1e-10, gtol=1e-10)
        n[0] += sol.nfev + sol.njev * len(idx)
        z = x.copy()
        z[idx] = sol.x
        if cost(z, parts) < cost(x, parts):
            x = z
        n[0] += 2

    for group, parts in STAGES:
        if "per_step_s" in group:  # engine-side: the op family scales join the host terms
            group = (*group, *(c for c in coords if c.startswith("scale_")))
        idx = [coords.index(c) for c in group if c in coords]
        if not idx:
            continue
        for span, pts, passes in ((1.0, 17, 2), (0.3, 9, 2)):
            for _ in range(passes):
                if not sweep(idx, span, pts, parts) or n[0] >= max_evals:
                    break
        if len(idx) > 1:  # correlated pairs (per-step vs per-request cost at batch B)
            newton(idx, parts, 0.1, 8)
    jac: list = []
    # by groups (host terms, then the frontend's): a host term moved by a few % shifts every
    # engine step, which would swamp the frontend's finer trade-offs in one joint step
    engine = ("per_step_s", "per_request_s")
    fe = [j for j, c in enumerate(coords) if c not in engine and not c.startswith("scale_")]
    host = [j for j, c in enumerate(coords) if c in engine or c.startswith("scale_")]
    for idx in (host, fe):
        if idx:
            x = _wide_newton(cost, residuals, x, lo, hi, n, max_evals - 7 * len(x), jac,
                             idx=idx)
    return x, cost(x)


def polish(cost, residuals, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, n: list,
           max_evals: int, fe: list[int]) -> np.ndarray:
    """Wide Gauss–Newton on the frontend's terms one by one (the host's are set by every
    step and settled by then); then jumps along the weakest directions of the last Jacobian
    (the floor of a valley where terms trade off, on which other runs' step-sized jumps leave
    local minima) and descent again from the best; a last ±0.05-decade sweep."""
    jac: list = []
    if fe:
        x = _wide_newton(cost, residuals, x, lo, hi, n, max_evals - 7 * len(x), jac, idx=fe)
    if jac and n[0] + 16 < max_evals - 7 * len(x):
        Jf = jac[-1][:, fe]
        _, vf = np.linalg.eigh(Jf.T @ Jf)
        best, start = cost(x), x
        n[0] += 1
        for k in range(min(2, len(fe))):
            v = np.zeros(len(x))
            v[fe] = vf[:, k]
            for step in (-0.6, -0.3, 0.3, 0.6):
                y = np.clip(start + step * v, lo, hi)
                c = cost(y)
                n[0] += 1
                if c < best:
                    x, best = y, c
        if x is not start:
            x = _wide_newton(cost, residuals, x, lo, hi, n, max_evals - 7 * len(x), jac,
                             radii=WIDE_RADII[-4:], idx=fe)
    ln10 = math.log(10)
    best = cost(x)
    for j in range(len(x)):
        for g in x[j] + np.linspace(-0.05, 0.05, 7) * ln10:
            if n[0] >= max_evals:
                return x
            y = x.copy()
            y[j] = float(np.clip(g, lo[j], hi[j]))
            c = cost(y)
            n[0] += 1
            if c < best:
                x, best = y, c
    return x


def _wide_newton(cost, residuals, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, n: list,
                 max_evals: int, jac: list | None = None,
                 radii: tuple[float, ...] | None = None,
                 idx: list[int] | None = None) -> np.ndarray:
    """Gauss–Newton with a wide Jacobian: central differences over ±``radius`` (log units,
    30% down to 3%) average the step-sized jumps out and keep the trend, including the
    valleys where parameters trade off (e.g. tokenization per token against the IPC hop).
    Each step (Levenberg-damped, full or half) is kept only when it lowers ``cost``."""
    idx = list(range(len(x))) if idx is None else list(idx)
    best = cost(x)
    n[0] += 1
    for radius in radii or WIDE_RADII:
        if n[0] + 2 * len(idx) + 3 > max_evals:
            break
        r0 = residuals(x)
        J = np.zeros((len(r0), len(x)))
        for j in idx:
            e = np.zeros(len(x))
            e[j] = radius
            J[:, j] = (residuals(np.clip(x + e, lo, hi)) - residuals(np.clip(x - e, lo, hi))) \
                / (2 * radius)
        n[0] += 1 + 2 * len(idx)
        if jac is not None:
            jac.append(J)
        A = J.T @ J + np.diag([0.0 if j in idx else 1e12 for j in range(len(x))])
        g = J.T @ r0
        for lam in (1e-3, 1e-1):
            try:
                delta = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -g)
            except np.linalg.LinAlgError:
                continue
            delta = np.clip(delta, -3 * radius - 0.5, 3 * radius + 0.5)
            improved = False
            for frac in (1.0, 0.5):
                y = np.clip(x + frac * delta, lo, hi)
                c = cost(y)
                n[0] += 1
                if c < best:
                    x, best, improved = y, c, True
                    break
            if improved:
                break
    return x


__all__ = ["polish", "search"]
