"""Run `simulate calibrate`'s plan on this GPU with a time limit: on SIGALRM the rows measured
so far are written (``partial: true`` in the file's source) instead of being lost.

    python benchmarks/device_calibrate.py GPU OUTPUT.json SECONDS [--quick]
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path


class _Stop(BaseException):  # not an Exception: measure_plan's per-shape guard lets it through
    pass


def main(argv: list[str]) -> int:
    import torch
    from servesim.kernels import calibrate as C
    from servesim.kernels.gemm import fp8_supported

    gpu, out, limit = argv[0], Path(argv[1]), int(argv[2])
    quick = "--quick" in argv
    plan = C.build_plan(gpu, quick, fp8=fp8_supported(), num_gpus=torch.cuda.device_count())
    doc = C.new_document(gpu, C.fingerprint(plan.mode), plan.peaks)
    print(f"{plan.mode}: {len(plan.gemm)} GEMM, {len(plan.decode)} decode, "
          f"{len(plan.prefill)} prefill, {len(plan.moe)} MoE shapes", flush=True)
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(_Stop()))
    signal.alarm(limit)
    t0 = time.perf_counter()
    try:
        C.measure_plan(plan, doc, C.BENCH_QUICK if quick else C.BENCH_FULL)
    except _Stop:
        doc["source"]["partial"] = True
    signal.alarm(0)
    doc["source"]["seconds"] = round(time.perf_counter() - t0, 1)
    print({k: len(v) for k, v in doc.items() if isinstance(v, list)}, flush=True)
    try:
        C.write_calibration(doc, out)
    except Exception as e:  # noqa: BLE001 -- never lose the rows
        print(f"write_calibration: {e}; raw JSON written", flush=True)
        out.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
