"""A fake point function: a bench-like dict from (tree, overrides, seed, rate), no simulator.

Common random numbers: the noise depends on the seed only, so arms of one seed share it.
``scheduler.max_num_batched_tokens < 100`` adds +200 ms TTFT (a planted difference);
``workload.num_prompts == 13`` raises (a failing point).
"""

from __future__ import annotations

import time

import numpy as np
from servesim.simulator.sweep import build_tree


def fake_point(base_tree: dict, overrides: list, seed: int, rate) -> dict:
    tree = build_tree(base_tree, overrides, seed, rate)
    if tree.get("workload", {}).get("num_prompts") == 13:
        raise RuntimeError("unlucky num_prompts\nsecond line of detail")
    mnbt = (tree.get("scheduler") or {}).get("max_num_batched_tokens") or 2048
    r = 1.0 if rate is None else float(rate)
    noise = np.random.default_rng(seed).normal(0.0, 20.0, size=3)
    ttft = 100.0 + 50.0 * r + noise[0] + (200.0 if mnbt < 100 else 0.0)
    return {
        "date": time.strftime("%Y%m%d-%H%M%S") + f".{time.perf_counter_ns()}",
        "request_rate": r,
        "completed": 10,
        "request_goodput": None,
        "output_throughput": 1000.0 + 10 * r + noise[1],
        "mean_ttft_ms": ttft,
        "p99_ttft_ms": ttft * 2 + noise[2],
        "mean_tpot_ms": 20.0 + noise[2] / 10,
        "latencies": [0.1, 0.2],
        "wall_seconds": 0.01,
    }
