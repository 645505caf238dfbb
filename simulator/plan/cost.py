"""Sizing and pricing a deployment of independent replicas; the Pareto set.

Money in USD, rates in req/s (ecosystem-formats §5 for the cost formulas).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from servesim.simulator.errors import ConfigError


def load_prices(path: str | Path | None = None) -> dict[str, dict]:
    """GPU name → {usd_per_gpu_hour, source, as_of} from a price YAML (default: the shipped
    configs/prices.yaml); a one-line ConfigError naming the file for a missing or bad one."""
    from servesim.simulator.config import load_yaml
    from servesim.simulator.errors import path_is_file

    if path:
        p = Path(path)
        if not path_is_file(p):
            raise ConfigError(f"{p}: price file not found")
    else:
        p = Path(__file__).resolve().parents[2] / "configs" / "prices.yaml"
        if not p.is_file():
            from importlib import resources

            try:
                p = Path(str(resources.files("servesim.configs").joinpath("prices.yaml")))
            except (ModuleNotFoundError, FileNotFoundError):
                raise ConfigError("prices.yaml: price file not found") from None
    tree = load_yaml(p)
    gpus = tree.get("gpus") if isinstance(tree, dict) else None
    if not isinstance(gpus, dict):
        raise ConfigError(f"{p}: expected a 'gpus:' mapping of name → {{usd_per_gpu_hour, ...}}")
    out = {}
    for name, v in gpus.items():
        if not isinstance(v, dict) or "usd_per_gpu_hour" not in v:
            raise ConfigError(f"{p}: gpus.{name}: expected usd_per_gpu_hour, source, as_of")
        try:
            price = float(v["usd_per_gpu_hour"])
        except (TypeError, ValueError):
            price = math.nan
        if isinstance(v["usd_per_gpu_hour"], bool) or not (math.isfinite(price) and price >= 0):
            raise ConfigError(f"{p}: gpus.{name}.usd_per_gpu_hour: expected a finite number "
                              f">= 0, got {v['usd_per_gpu_hour']!r}")
        out[str(name)] = {"usd_per_gpu_hour": price,
                          "source": str(v.get("source", "")), "as_of": str(v.get("as_of", ""))}
    return out


def deployment_cost(target_rps: float, capacity_rps: float, gpus_per_replica: int,
                    usd_per_gpu_hour: float, mean_output_len: float,
                    replicas: int | None = None) -> dict[str, float]:
    """Size and price a deployment of independent replicas (ecosystem-formats §5).

    replicas = ceil(target / capacity) unless given (the planner adds replicas when the
    simulated operating point misses an SLO); GPUs = replicas × gpus_per_replica;
    $/h = GPUs × price; output tokens/s = target × mean output length;
    $/1M output tokens = $/h / (output tokens/s × 3600) × 1e6;
    utilization_of_knee = (target / replicas) / capacity.
    """
    if not (capacity_rps > 0):
        return {"replicas": math.nan, "gpus": math.nan, "usd_per_hour": math.nan,
                "usd_per_1m_output_tokens": math.nan, "operating_rps_per_replica": math.nan,
                "utilization_of_knee": math.nan}
    replicas = replicas or replicas_for(target_rps, capacity_rps)
    gpus = replicas * gpus_per_replica
    usd_h = gpus * usd_per_gpu_hour
    out_tps = target_rps * mean_output_len
    per_1m = usd_h / (out_tps * 3600.0) * 1e6 if out_tps > 0 else math.nan
    op = target_rps / replicas
    return {"replicas": replicas, "gpus": gpus, "usd_per_hour": usd_h,
            "usd_per_1m_output_tokens": per_1m, "operating_rps_per_replica": op,
            "utilization_of_knee": op / capacity_rps}


def replicas_for(target_rps: float, capacity_rps: float) -> int:
    """ceil(target / capacity): independent replicas that carry ``target_rps`` at ≤ capacity."""
    return math.ceil(target_rps / capacity_rps - 1e-9)


def pareto_mask(x: Iterable[float], y: Iterable[float]) -> np.ndarray:
    """Points not dominated when maximizing both x and y (NaNs never on the front)."""
    x = np.asarray(list(x), dtype=float)
    y = np.asarray(list(y), dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    mask = np.zeros(len(x), dtype=bool)
    for i in np.flatnonzero(ok):
        dom = ok & (x >= x[i]) & (y >= y[i]) & ((x > x[i]) | (y > y[i]))
        mask[i] = not dom.any()
    return mask

