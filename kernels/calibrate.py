"""``simulate calibrate``: time the plan's kernel shapes on this GPU and write the calibration
file; this module is also the calibration harness's API (the CLI, bench and tests import it).

Timing (``run_calibration``, ``measure_plan``) imports torch and Triton and needs a CUDA GPU;
everything else does not. The work lives in:

- ``calibration_plan``      shapes to time, from the model catalog, and their FLOPs/bytes
- ``calibration_estimate``  benchmark-loop settings and the plan's duration (``--dry-run``)
- ``calibration_file``      schema check, reading, atomic YAML/JSON writing
- ``calibration_report``    ``simulate calibrate report`` and ``check`` text

Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path

from servesim.kernels.calibration_estimate import (
    BENCH_FULL,
    BENCH_QUICK,
    BenchSettings,
    estimate_plan,
    format_plan,
)
from servesim.kernels.calibration_file import (
    ROW_KEYS,
    new_document,
    read_calibration,
    write_calibration,
)
from servesim.kernels.calibration_plan import (
    CONFIGS_DIR,
    FALLBACK_MODELS,
    FALLBACK_PEAKS,
    LM_HEAD_MAX_M,
    M_FULL,
    MOE_TOKENS,
    DecodeShape,
    GemmShape,
    MoeShape,
    Plan,
    PrefillShape,
    _head_dim,
    build_plan,
    decode_flops_bytes,
    gemm_flops_bytes,
    load_models,
    model_attention,
    model_gemms,
    moe_flops_bytes,
    prefill_flops_bytes,
)
from servesim.kernels.calibration_report import check_file, check_lines, report_lines
from servesim.simulator.errors import Interrupted, ServesimError

NO_GPU_MESSAGE = ("simulate calibrate needs a CUDA GPU (torch.cuda.is_available() is False); "
                  "use --dry-run to see the plan")
BLOCK_SIZE = 16  # vLLM's default KV block size


def _timed(r: dict) -> dict:
    """``seconds`` and ``kernel`` of a Triton/vendor measurement: vLLM's own kernel when it
    was measured (what vLLM runs), else the faster of the two."""
    if r.get("vendor_s") and str(r.get("vendor_impl")).startswith("vllm "):
        return {"seconds": r["vendor_s"], "kernel": r["vendor_impl"]}
    cand = [(r.get("vendor_s"), r.get("vendor_impl") or "vendor"), (r.get("triton_s"),
                                                                       "triton")]
    cand = [(t, k) for t, k in cand if t]
    t, k = min(cand)
    return {"seconds": t, "kernel": k}


def yielded_families(path: Path, gpu: str) -> list[str]:
    """One line per family of the file at ``path`` that ``hardware.calibration: auto`` takes
    from the shipped file instead (measured only on stand-ins for vLLM's kernels)."""
    from servesim.costmodels.calibration import Calibration, configs_dir, read_doc

    shipped = next((p for ext in (".yaml", ".json")
                    if (p := configs_dir() / "calibration" / f"{gpu}{ext}").is_file()), None)
    if shipped is None:
        return []
    mine = read_doc(path, cached=False)
    cal = Calibration([path, shipped], [mine, read_doc(shipped)])
    out = []
    for fam in cal.yielded:
        ours = ", ".join(sorted({str(r["kernel"]) for r in mine[fam] if r.get("kernel")}))
        why = ("vLLM's kernel failed its check, see vllm_error" if any(
            r.get("vllm_error") for r in mine[fam]) else "no vLLM kernel here")
        out.append(f"note: {fam} was timed on stand-ins for vLLM's kernels ({ours}; {why}): "
                   f"under hardware.calibration: auto the shipped {shipped.name} "
                   f"({', '.join(cal.kernels[fam])}) keeps it")
    return out


def utc_now() -> str:
    """Now, UTC, to the second: ``2026-01-01T00:00:00Z``."""
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def fingerprint(mode: str) -> dict:
    """Device and software versions (needs torch; call on the GPU machine)."""
    import subprocess
    from importlib import metadata

    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False, timeout=20,
        ).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = None
    try:
        version = metadata.version("servesim")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    return {"device_name": props.name, "sm_count": props.multi_processor_count,
            "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__,
            "triton": triton.__version__, "date": utc_now(), "servesim_version": version,
            "mode": mode, "compute_capability": f"{props.major}.{props.minor}"}


def require_gpu() -> None:
    """Raise the one-line error when torch or a CUDA GPU is missing."""
    try:
        import torch
    except ImportError:
        raise ServesimError("simulate calibrate needs torch and triton (pip install -e "
                            "'.[kernels]'); use --dry-run to see the plan") from None
    if not torch.cuda.is_available():
        raise ServesimError(NO_GPU_MESSAGE)


def run_calibration(gpu: str, output: Path, quick: bool = False, *, progress=None,
                    log=print, time_limit: float | None = None) -> Path:
    """Time every shape of the plan on the current GPU and write the calibration file.

    ``time_limit`` (seconds): start no shape after it. The rows measured so far then go to
    :func:`partial_path` (``source.partial`` says after how many shapes it stopped); Ctrl-C /
    SIGTERM writes them there too, then raises :class:`Interrupted`."""
    require_gpu()
    import torch
    from servesim.kernels.gemm import fp8_supported

    fp8 = fp8_supported()
    plan = build_plan(gpu, quick, fp8=fp8, num_gpus=torch.cuda.device_count())
    for n in plan.notes:
        log(f"note: {n}")
    fpr = fingerprint(plan.mode)
    log(f"calibrating {gpu} on {fpr['device_name']} ({plan.mode}): {len(plan.gemm)} GEMM, "
        f"{len(plan.decode)} decode, {len(plan.prefill)} prefill, {len(plan.moe)} MoE, "
        f"{len(plan.allreduce)} all-reduce shapes")
    doc = new_document(gpu, fpr, plan.peaks)
    settings = BENCH_QUICK if quick else BENCH_FULL
    deadline = None if time_limit is None else time.monotonic() + time_limit
    try:
        measure_plan(plan, doc, settings, progress=progress, deadline=deadline)
    except KeyboardInterrupt:
        if not _has_rows(doc):
            raise Interrupted("no kernel was measured; nothing was written") from None
        path = write_calibration(doc, partial_path(output))
        raise Interrupted(f"{doc['source']['partial']}; written to {path}") from None
    if doc.get("skipped"):
        log(f"skipped {len(doc['skipped'])} shapes (listed under 'skipped' in the file)")
    if doc["source"].get("partial"):
        if not _has_rows(doc):
            raise ServesimError(f"simulate calibrate: {doc['source']['partial']}, before any "
                                "GEMM, attention or MoE kernel: nothing was written")
        return write_calibration(doc, partial_path(output))
    return write_calibration(doc, output)


def partial_path(output: Path) -> Path:
    """Where a partial calibration goes: ``NAME.partial.yaml`` beside ``NAME.yaml``, so that
    neither ``hardware.calibration: auto`` nor a complete earlier file is replaced by it."""
    output = Path(output)
    return output.with_name(f"{output.stem}.partial{output.suffix}")


def _has_rows(doc: dict) -> bool:
    """Whether ``doc`` has a row the cost model reads (memcpy alone is not a calibration)."""
    from servesim.costmodels.calibration import FAMILIES

    return any(doc.get(f) for f in FAMILIES)


def measure_plan(plan: Plan, doc: dict, settings: BenchSettings, *, progress=None,
                 deadline: float | None = None) -> dict:
    """Time every shape of ``plan`` and append rows to ``doc`` (failed shapes -> 'skipped').

    ``deadline`` (``time.monotonic()`` seconds): no shape starts after it. A stop there, or a
    KeyboardInterrupt (re-raised), leaves ``doc['source']['partial']`` saying after how many
    shapes it stopped."""
    total = len(plan.memcpy) + len(plan.gemm) + len(plan.decode) + len(plan.prefill) + len(
        plan.moe) + len(plan.allreduce)
    done = [0]
    try:
        _measure(plan, doc, settings, progress, deadline, total, done)
    except _TimeUp:
        doc["source"]["partial"] = f"time limit reached after {done[0]} of {total} shapes"
    except KeyboardInterrupt:
        doc["source"]["partial"] = f"stopped by Ctrl-C/SIGTERM after {done[0]} of {total} shapes"
        raise
    return doc


class _TimeUp(Exception):
    pass


def _measure(plan: Plan, doc: dict, settings: BenchSettings, progress, deadline, total: int,
             done: list[int]) -> None:
    from servesim.kernels import bench as B

    tick = progress(total) if progress else (lambda: None)

    def advance():
        done[0] += 1
        tick()

    def guarded(what, fn):
        if deadline is not None and time.monotonic() >= deadline:
            raise _TimeUp
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 -- OOM, compile failure: record the shape, go on
            doc.setdefault("skipped", []).append(
                f"{what}: {e.__class__.__name__}: {str(e).splitlines()[0][:120]}")
            B.release()
            r = None
        advance()  # (not after a KeyboardInterrupt: that shape was not done)
        return r

    for nbytes in plan.memcpy:
        s = guarded(f"memcpy {nbytes}", lambda nbytes=nbytes: B.time_memcpy(nbytes, settings))
        if s:
            doc["memcpy"].append({"bytes": nbytes, "seconds": s, "traffic_bytes": 2 * nbytes})
    for g in plan.gemm:
        r = guarded(f"gemm {g}", lambda g=g: B.time_gemm(g.m, g.n, g.k, g.dtype, settings))
        if r:
            fl, by = gemm_flops_bytes(g.m, g.n, g.k, g.dtype)
            doc["gemm"].append({"m": g.m, "n": g.n, "k": g.k, "dtype": g.dtype, "flops": fl,
                                "bytes": by, **r, **_timed(r), "ops": g.ops})
    for d in plan.decode:
        r = guarded(f"decode {d}", lambda d=d: B.time_decode(d, BLOCK_SIZE, settings))
        if r:
            fl, by = decode_flops_bytes(d)
            row = {"batch": d.batch, "context": d.context, "context_max": d.context_max,
                   "num_heads": d.num_heads, "num_kv_heads": d.num_kv_heads,
                   "head_dim": d.head_dim, "block_size": BLOCK_SIZE, "dtype": d.dtype,
                   "flops": fl, "bytes": by, **r, **_timed(r)}
            if d.kv_dtype != d.dtype:
                row["kv_dtype"] = d.kv_dtype
            doc["decode_attention"].append(row)
    for f in plan.prefill:
        r = guarded(f"prefill {f}", lambda f=f: B.time_prefill(f, BLOCK_SIZE, settings))
        if r:
            fl, by = prefill_flops_bytes(f)
            doc["prefill_attention"].append({
                "batch": f.batch, "chunk": f.chunk, "context": f.context,
                "num_heads": f.num_heads, "num_kv_heads": f.num_kv_heads,
                "head_dim": f.head_dim, "dtype": f.dtype, "flops": fl, "bytes": by, **r,
                **_timed(r)})
    for m in plan.moe:
        r = guarded(f"moe {m}", lambda m=m: B.time_moe(m, settings))
        if r:
            fl, by = moe_flops_bytes(m)
            doc["moe"].append({"dtype": m.dtype, "distribution": "balanced", "hidden": m.hidden,
                               "inter": m.inter, "topk": m.topk, "experts": m.experts,
                               "tp": m.tp, "ep": 1, "tokens": m.tokens, "flops": fl,
                               "bytes": by, "seconds": r["seconds"], "kernel": r["kernel"]})
    by_tp: dict[int, list[int]] = {}
    for tp, nbytes in plan.allreduce:
        by_tp.setdefault(tp, []).append(nbytes)
    for tp, sizes in sorted(by_tp.items()):
        rows = guarded(f"allreduce tp={tp}", lambda tp=tp, sizes=sizes: B.time_allreduce(
            tp, sizes, settings))
        for _ in sizes[1:]:
            advance()
        for mode, nbytes, sec in rows or []:
            doc["allreduce"].append({"mode": mode, "dtype": "bfloat16", "tp": tp,
                                     "bytes": nbytes, "seconds": sec,
                                     "kernel": f"torch.distributed nccl ({mode})"})


__all__ = [  # the harness API; _head_dim for the tests
    "CONFIGS_DIR",
    "FALLBACK_MODELS",
    "FALLBACK_PEAKS",
    "LM_HEAD_MAX_M",
    "MOE_TOKENS",
    "M_FULL",
    "NO_GPU_MESSAGE",
    "ROW_KEYS",
    "BenchSettings",
    "DecodeShape",
    "GemmShape",
    "MoeShape",
    "Plan",
    "PrefillShape",
    "_head_dim",
    "build_plan",
    "check_file",
    "check_lines",
    "decode_flops_bytes",
    "estimate_plan",
    "format_plan",
    "gemm_flops_bytes",
    "load_models",
    "measure_plan",
    "model_attention",
    "model_gemms",
    "moe_flops_bytes",
    "new_document",
    "prefill_flops_bytes",
    "read_calibration",
    "report_lines",
    "require_gpu",
    "run_calibration",
    "write_calibration",
]
