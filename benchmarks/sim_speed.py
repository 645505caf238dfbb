"""Simulator speed benchmark (engine-core issue): simulated seconds per wall second.

Llama-3.1-8B on one A100-SXM4-80GB (vLLM defaults: max_num_seqs 256, 2048-token budget,
prefix caching on, async scheduling), `vllm bench serve` random dataset 1024 in / 128 out
(range 0.25), all requests sent at t=0 by default (request_rate inf: far past saturation, 256
running, the rest queued) or at ``--rate`` requests/s (Poisson).

    python benchmarks/sim_speed.py                      # 20,000 requests, fast path on
    python benchmarks/sim_speed.py --compare-exact      # also the per-request loop, same run
    python benchmarks/sim_speed.py --profile            # cProfile top 15 by tottime
    python benchmarks/sim_speed.py --rate 10            # 10 requests/s (mostly decode steps)
    python benchmarks/sim_speed.py --preset 1m          # 1,000,000 requests, rate inf, 1 run
    python benchmarks/sim_speed.py --preset 1m --rate 10
    python benchmarks/sim_speed.py --preset scaling     # µs per step from 10k to 1M requests
    python benchmarks/sim_speed.py --preset startup     # `simulate run` start-up (1,000 req.)

Each run prints wall time, engine steps per wall second, simulated seconds per wall second
(×real time), µs per engine step and the process's peak RSS. Timings on shared machines are
noisy: run it several times (``--repeats``) and compare medians; `run_experiment` is timed
(workload, memory plan, cost model and simulation), not the interpreter's start-up.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def config(num_prompts: int, rate: str):
    from servesim.simulator.config import load_config, resolve_config

    cfg = load_config(ROOT / "configs" / "llama8b_a100.yaml", [
        f"workload.num_prompts={num_prompts}", f"workload.request_rate={rate}",
        "workload.input_len=1024", "workload.output_len=128", "workload.range_ratio=0.25",
    ])
    return resolve_config(cfg)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def once(cfg, fast_path: bool) -> dict:
    from servesim.simulator.runner import run_experiment

    t0, c0 = time.perf_counter(), time.process_time()
    res = run_experiment(cfg, resolved=True, fast_path=fast_path)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    c = res.counters
    reasons = res.requests["finished_reason"]
    completed = sum(int((w["finished_reason"] == "length").sum())
                    for w in res.iter_requests()) if res.streamed else \
        int((reasons == "length").sum())
    res.close()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "sim_s": c["sim_seconds"],
        "steps": c["num_steps"],
        "speed": c["sim_seconds"] / wall,
        "steps_per_s": c["num_steps"] / wall,
        "us_per_step": wall / max(c["num_steps"], 1) * 1e6,
        "completed": completed,
    }


def report(name: str, n: int, rate: str, runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"[{name}] {n} requests at rate {rate}: {med['steps']:.0f} steps, simulated "
          f"{med['sim_s']:.1f} s, {med['completed']:.0f} completed")
    print(f"  wall {med['wall_s']:.2f} s (median of {len(runs)}: "
          f"{', '.join(format(r['wall_s'], '.2f') for r in runs)}); CPU {med['cpu_s']:.2f} s "
          f"(on a busy machine wall exceeds CPU: {med['sim_s'] / med['cpu_s']:.0f}x real time "
          "per CPU second)")
    print(f"  {med['steps_per_s']:.0f} steps/s, {med['speed']:.0f}x real time (simulated s per "
          f"wall s), {med['us_per_step']:.1f} us per step")
    print(f"  peak RSS {peak_rss_mib():.0f} MiB")
    sys.stdout.flush()
    return med


def scaling(rate: str, sizes: list[int], repeats: int) -> None:
    """Each size in a fresh process (peak RSS per size), µs per step side by side."""
    rows = []
    for n in sizes:
        out = subprocess.run(
            [sys.executable, __file__, "--num-prompts", str(n), "--rate", rate, "--repeats",
             str(repeats if n <= 100_000 else 1), "--machine"],
            check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        wall, steps, us, rss, cpu = (float(x) for x in out.split())
        rows.append((n, wall, steps, us, rss, cpu / steps * 1e6))
        print(f"{n:>9} requests: wall {wall:7.2f} s, {steps:9.0f} steps, {us:6.1f} us/step "
              f"(CPU {cpu / steps * 1e6:6.1f} us/step), peak RSS {rss:5.0f} MiB")
        sys.stdout.flush()
    for col, name in ((3, "wall"), (5, "CPU")):
        lo, hi = min(r[col] for r in rows), max(r[col] for r in rows)
        print(f"{name} us/step spread: {hi / lo - 1:.1%} (max/min - 1)")


_CHILD = """
import sys, time
t_parent = float(sys.argv[1])
import simpy
run = simpy.Environment.run
def timed(self, *a, **k):
    sys.stderr.write(f"STARTUP {time.time() - t_parent:.4f}\\n")
    return run(self, *a, **k)
simpy.Environment.run = timed
from servesim.simulator.cli import main
main(sys.argv[2:])
"""


def startup(repeats: int) -> None:
    """Wall seconds from launching ``simulate run configs/llama8b_a100.yaml`` (1,000 requests)
    to the start of its event loop: interpreter, imports, config, memory plan, cost model,
    workload and output folder, with Python's bytecode cache (its default)."""
    import os
    import tempfile

    def child(env) -> float:
        with tempfile.TemporaryDirectory() as d:
            t = time.time()
            err = subprocess.run(
                [sys.executable, "-c", _CHILD, repr(t), "run",
                 str(ROOT / "configs" / "llama8b_a100.yaml"), "-o", f"{d}/run", "--quiet"],
                check=True, capture_output=True, text=True, env=env).stderr
            return float(err.split("STARTUP ")[1].split()[0])

    # Python's default (PYTHONDONTWRITEBYTECODE unset): the first, untimed run writes
    # __pycache__; where that is set and nothing is cached, each start also compiles the
    # project's modules (~70 ms more on the 2-core CI machine)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    child(env)
    times = [child(env) for _ in range(repeats)]
    print(f"simulate run start-up (to the event loop): median {statistics.median(times):.3f} s,"
          f" min {min(times):.3f} s ({', '.join(format(x, '.3f') for x in times)})")


def main() -> None:
    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests (default 20,000; the 1m preset: 1,000,000)")
    ap.add_argument("--rate", default="inf", help="requests/s, or inf (default)")
    ap.add_argument("--repeats", type=int, default=None, help="runs (median; default 3, 1m: 1)")
    ap.add_argument("--preset", choices=["default", "1m", "scaling", "startup"],
                    default="default")
    ap.add_argument("--compare-exact", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--machine", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.preset == "startup":
        startup(a.repeats or 7)
        return
    if a.preset == "scaling":
        scaling(a.rate, [10_000, 100_000, 1_000_000], a.repeats or 3)
        return
    n = a.num_prompts or (1_000_000 if a.preset == "1m" else 20_000)
    repeats = a.repeats or (1 if n >= 1_000_000 else 3)
    cfg = config(n, a.rate)
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        once(cfg, True)
        prof.disable()
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(15)
        return
    if a.machine:  # one line for --preset scaling: wall, steps, us/step, peak RSS, CPU
        runs = [once(cfg, True) for _ in range(repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(med["wall_s"], med["steps"], med["us_per_step"], peak_rss_mib(), med["cpu_s"])
        return
    modes = [True, False] if a.compare_exact else [True]
    for fast in modes:
        runs = [once(cfg, fast) for _ in range(repeats)]
        report("fast path" if fast else "exact per-request loop", n, a.rate, runs)


if __name__ == "__main__":
    main()
