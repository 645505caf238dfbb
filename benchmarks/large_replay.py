"""Bounded-memory benchmark (issue 16): peak RSS and wall time of a long replay, end to end.

Runs, as a child process under ``/usr/bin/time -v`` (falls back to ``getrusage``):

    simulate run configs/llama8b_a100.yaml --set workload.num_prompts=N \\
        --set workload.request_rate=100 -o DIR -q

At 100 req/s the A100 serves ~11 req/s, so ~89% of the requests wait at the peak: the run
exercises the compact parked queue, the spilled per-request chunks (N > 1M), the DDSketch
percentiles and the streamed requests.csv / result.json writing. Target: peak RSS < 1 GB at
N = 10,000,000 (tens of minutes on a shared 2-core machine).

    python benchmarks/large_replay.py                       # N = 10,000,000
    python benchmarks/large_replay.py --num-prompts 200000  # a quick look
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=10_000_000)
    ap.add_argument("--request-rate", type=float, default=100.0)
    ap.add_argument("--keep", type=Path, help="write the run folder here instead of a temp dir")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="servesim-large-"))
    out = a.keep or tmp / "run"
    cmd = [sys.executable, "-m", "servesim.simulator.cli", "run",
           str(ROOT / "configs" / "llama8b_a100.yaml"),
           "--set", f"workload.num_prompts={a.num_prompts}",
           "--set", f"workload.request_rate={a.request_rate}", "-o", str(out), "-q"]
    timer = shutil.which("time") or ("/usr/bin/time" if Path("/usr/bin/time").exists() else None)
    t0 = time.perf_counter()
    if timer:
        r = subprocess.run([timer, "-v", *cmd], check=False, capture_output=True, text=True)
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
        peak_mb = int(m.group(1)) / 1024 if m else float("nan")
    else:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True)
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"simulate run failed ({r.returncode}): {r.stderr[-2000:]}")
    res = json.loads((out / "result.json").read_text())
    info = json.loads((out / "run_info.json").read_text())
    print(f"requests {a.num_prompts:,} at {a.request_rate:g} req/s: completed "
          f"{res['completed']:,}, duration {res['duration']:,.0f} s simulated")
    print(f"peak RSS {peak_mb:,.0f} MB; wall {wall:,.0f} s (simulation {info['wall_seconds']:,.0f}"
          f" s, writing and metrics {wall - info['wall_seconds']:,.0f} s)")
    print(f"approximate percentiles: {res.get('approximate_percentiles', 'none (exact)')}")
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
