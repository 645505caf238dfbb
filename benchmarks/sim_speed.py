"""Simulator speed benchmark (engine-core issue): simulated seconds per wall second.

Llama-3.1-8B on one A100-SXM4-80GB (vLLM defaults: max_num_seqs 256, 2048-token budget,
prefix caching on), `vllm bench serve` random dataset 1024 in / 128 out (range 0.25), all
requests sent at t=0 (request_rate inf: far past saturation, 256 running, the rest queued).

    python benchmarks/sim_speed.py                      # 20,000 requests, fast path on
    python benchmarks/sim_speed.py --compare-exact      # also the per-request loop, same run
    python benchmarks/sim_speed.py --profile            # cProfile top 15 by tottime
    python benchmarks/sim_speed.py --num-prompts 100000 # peak memory check (RSS printed)

Timings on shared machines are noisy: run it several times and compare medians.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment

ROOT = Path(__file__).resolve().parents[1]


def config(num_prompts: int, rate: str):
    cfg = load_config(ROOT / "configs" / "llama8b_a100.yaml", [
        f"workload.num_prompts={num_prompts}", f"workload.request_rate={rate}",
        "workload.input_len=1024", "workload.output_len=128", "workload.range_ratio=0.25",
    ])
    return resolve_config(cfg)


def once(cfg, fast_path: bool) -> dict:
    t0 = time.perf_counter()
    res = run_experiment(cfg, resolved=True, fast_path=fast_path)
    wall = time.perf_counter() - t0
    c = res.counters
    running = res.steps["vllm:num_requests_running"]
    return {
        "wall_s": wall,
        "sim_s": c["sim_seconds"],
        "steps": c["num_steps"],
        "speed": c["sim_seconds"] / wall,
        "steps_per_s": c["num_steps"] / wall,
        "median_running": float(statistics.median(running)) if len(running) else 0.0,
        "completed": int((res.requests["finished_reason"] == "length").sum()),
    }


def main() -> None:
    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=20_000)
    ap.add_argument("--rate", default="inf")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare-exact", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    cfg = config(a.num_prompts, a.rate)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        once(cfg, True)
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
        return
    modes = [True, False] if a.compare_exact else [True]
    for fast in modes:
        runs = [once(cfg, fast) for _ in range(a.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        name = "fast path" if fast else "exact per-request loop"
        print(f"[{name}] {a.num_prompts} requests, {med['steps']:.0f} steps, "
              f"simulated {med['sim_s']:.1f} s, median running {med['median_running']:.0f}")
        print(f"  wall {med['wall_s']:.2f} s (median of {a.repeats}: "
              f"{', '.join(format(r['wall_s'], '.2f') for r in runs)})")
        print(f"  {med['steps_per_s']:.0f} engine steps per wall second, "
              f"{med['speed']:.0f}x real time (simulated s per wall s)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()
