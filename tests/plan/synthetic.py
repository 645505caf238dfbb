"""A fast synthetic stand-in for the simulator: a monotone latency-vs-rate curve per GPU."""

from __future__ import annotations

import math

import numpy as np
from servesim.simulator.errors import CapacityError
from servesim.simulator.plan.spec import get_path

# per-replica "true" capacity scale per GPU (req/s at which P99 TTFT reaches ~1 s)
BASE = {"a100-sxm4-80gb": 6.0, "h100-sxm": 14.0, "l40s": 3.0}


def true_capacity(tree: dict, seed: int, noise: float = 0.04) -> float:
    hw = get_path(tree, "hardware.name", "a100-sxm4-80gb")
    tp = get_path(tree, "parallel.tensor_parallel_size", 1) or 1
    cap = BASE.get(hw, 5.0) * (1.7 if tp == 2 else 1.0)
    return cap * (1 + noise * np.random.default_rng(1000 + seed).standard_normal())


def synthetic_eval(tree, rate, seed, slo, cand):
    """Latencies (ms) rise smoothly and steeply as rate approaches capacity (monotone); the
    point record holds the planner's metrics under ``plan_point``, as evaluate_point's does."""
    cap = true_capacity(tree, seed)
    u = rate / cap
    ttft = 150 + 850 * u ** 6
    tpot = 20 + 25 * u ** 3
    m = {"num_requests": 200, "completed": 200, "failed": 0}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("e2el", ttft + 129 * tpot)):
        m[f"mean_{name}_ms"] = v * 0.6
        m[f"p50_{name}_ms"] = v * 0.5
        m[f"p90_{name}_ms"] = v * 0.8
        m[f"p99_{name}_ms"] = v
        m[f"slo_p_{name}_ms"] = v
    served = min(rate, cap * 1.05)
    m.update(request_throughput=served, output_throughput=served * 130,
             total_token_throughput=served * 1150, mean_output_len=130.0,
             request_goodput=served if ttft <= slo.get("ttft_ms") or math.inf else 0.0,
             goodput_pct=100.0 if ttft <= (slo.get("ttft_ms") or math.inf) else 50.0,
             num_preemptions=0.0, max_concurrent_requests=max(1.0, rate * 3.0))
    return {"request_rate": rate, "plan_point": m}


def synthetic_fit(tree, source):
    """L40S with TP1 'does not fit' (as a CapacityError would say)."""
    hw = get_path(tree, "hardware.name")
    tp = get_path(tree, "parallel.tensor_parallel_size", 1)
    if hw == "l40s" and tp == 1:
        raise CapacityError(f"{source}: model weights 16.1 GiB + activations exceed 44.6 GiB "
                            "usable at gpu_memory_utilization 0.9 (test)")
    return None, None
