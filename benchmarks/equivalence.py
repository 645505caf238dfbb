"""Check that two versions of servesim simulate the same runs (speed work must not change a
decision): every request's schedule, token counts and preemptions identical, times equal within
a relative tolerance (summation order may change the last bits).

Run ``dump`` with each version's interpreter (an editable install resolves ``servesim`` to its
own checkout), then ``compare``::

    /path/to/old/.venv/bin/python benchmarks/equivalence.py dump /tmp/old.pkl
    .venv/bin/python benchmarks/equivalence.py dump /tmp/new.pkl
    .venv/bin/python benchmarks/equivalence.py compare /tmp/old.pkl /tmp/new.pkl

Cases: the example configs in ``configs/`` plus variants that take every engine path (sync and
async scheduling, pipeline parallelism, sliding window, prefix sharing, sessions, priority,
rate inf, max_concurrency, data parallelism, other allocators), the benchmark client's stages,
warm-up and timeouts, clusters (prefix-aware router, P/D, CPU offload), speculative decoding,
multi-LoRA, and runs with and without the API-server frontend (on by default). With ``--trace``
every engine step's schedule ({request: tokens}, preemptions) is recorded and compared too.
``--rtol 0`` demands bit-identical floats, ITL samples in the same order and the same
``result.json`` (date aside).
"""

from __future__ import annotations

import argparse
import math
import pickle
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

A100 = ROOT / "configs" / "llama8b_a100.yaml"
CASES: dict[str, tuple[Path | None, list[str]]] = {
    "llama8b_a100": (A100, []),
    "llama70b_h100_tp4": (ROOT / "configs" / "llama70b_h100_tp4.yaml", []),
    "mixtral_h100_tp2": (ROOT / "configs" / "mixtral_h100_tp2.yaml", []),
    "qwen7b_l40s": (ROOT / "configs" / "qwen7b_l40s.yaml", []),
    "deepseek_v3_h200_tp8": (ROOT / "configs" / "deepseek_v3_h200_tp8.yaml", []),
    "a100_sync": (A100, ["scheduler.async_scheduling=false"]),
    "a100_rate_inf": (A100, ["workload.num_prompts=3000", "workload.request_rate=inf"]),
    "a100_rate_inf_sync": (A100, ["workload.num_prompts=2000", "workload.request_rate=inf",
                                  "scheduler.async_scheduling=false"]),
    "a100_small_cache": (A100, ["cache.num_gpu_blocks_override=800", "model.max_model_len=12800",
                                "workload.request_rate=20"]),
    "a100_small_cache_sync": (A100, ["cache.num_gpu_blocks_override=800", "model.max_model_len=12800",
                                     "workload.request_rate=20",
                                     "scheduler.async_scheduling=false"]),
    "a100_prefix": (A100, ["workload.prefix_len=300", "workload.request_rate=30"]),
    "a100_priority": (A100, ["scheduler.policy=priority", "workload.request_rate=20",
                             "cache.num_gpu_blocks_override=1200", "model.max_model_len=19200"]),
    "a100_concurrency": (A100, ["workload.max_concurrency=16", "workload.request_rate=inf"]),
    "a100_pp2": (A100, ["parallel.pipeline_parallel_size=2"]),
    "a100_pp2_sync": (A100, ["parallel.pipeline_parallel_size=2",
                             "scheduler.async_scheduling=false"]),
    "a100_dp2": (A100, ["parallel.data_parallel_size=2", "workload.request_rate=20"]),
    "a100_no_prefix_cache": (A100, ["cache.enable_prefix_caching=false",
                                    "workload.request_rate=20"]),
    "a100_lfu": (A100, ["cache.allocator=paged_lfu", "workload.prefix_len=200",
                        "cache.num_gpu_blocks_override=1500", "model.max_model_len=24000", "workload.request_rate=20"]),
    "a100_contiguous": (A100, ["cache.allocator=contiguous", "model.max_model_len=4096"]),
    # --cpu-offload-gb (UVA weight reads every step) and max_model_len auto on a small cache
    "a100_weight_offload": (A100, ["cpu_offload_gb=2", "workload.request_rate=20"]),
    "mistral_auto_len": (A100, ["model.name=mistral-7b-v0.1", "model.max_model_len=auto",
                                "cache.num_gpu_blocks_override=900", "workload.input_len=3000",
                                "workload.num_prompts=200", "workload.request_rate=4"]),
    "mistral_sliding_window": (A100, ["model.name=mistral-7b-v0.1", "workload.input_len=6000",
                                      "workload.num_prompts=200", "workload.request_rate=2"]),
    "mistral_sw_prefix": (A100, ["model.name=mistral-7b-v0.1", "workload.input_len=6000",
                                 "workload.output_len=600", "workload.num_prompts=100",
                                 "workload.request_rate=8", "workload.prefix_len=4500",
                                 "cache.num_gpu_blocks_override=1200"]),
    "a100_priority_prefix_sync": (A100, ["scheduler.policy=priority", "workload.request_rate=20",
                                         "cache.num_gpu_blocks_override=1200", "model.max_model_len=19200",
                                         "workload.prefix_len=100",
                                         "scheduler.async_scheduling=false"]),
    "sessions": (None, ["workload.kind=sessions", "workload.num_sessions=60",
                        "workload.turns=4", "workload.session_rate=2"]),
    "sessions_sync": (None, ["workload.kind=sessions", "workload.num_sessions=40",
                             "workload.turns=3", "workload.session_rate=2",
                             "scheduler.async_scheduling=false"]),
    # -- without the API-server frontend (the engine's own times) -----------------------------
    "a100_no_frontend": (A100, ["frontend.enable=false"]),
    "a100_no_frontend_sync": (A100, ["frontend.enable=false", "scheduler.async_scheduling=false"]),
    "a100_rate_inf_no_frontend": (A100, ["frontend.enable=false", "workload.num_prompts=3000",
                                         "workload.request_rate=inf"]),
    "a100_small_cache_no_frontend": (A100, ["frontend.enable=false",
                                            "cache.num_gpu_blocks_override=800", "model.max_model_len=12800",
                                            "workload.request_rate=20"]),
    "a100_dp2_api2": (A100, ["parallel.data_parallel_size=2", "workload.request_rate=20",
                             "frontend.api_server_count=3"]),
    # -- benchmark client: stages, warm-up, timeouts (aborts), retries ------------------------
    "a100_timeouts": (A100, ["workload.num_prompts=300", "workload.input_len=2048",
                             "workload.output_len=256", "workload.request_rate=40",
                             "cache.num_gpu_blocks_override=2000", "model.max_model_len=32000",
                             "client.request_timeout_s=15",
                             "client.max_retries=1"]),
    "a100_timeouts_sync": (A100, ["workload.num_prompts=300", "workload.input_len=2048",
                                  "workload.output_len=256", "workload.request_rate=40",
                                  "cache.num_gpu_blocks_override=2000", "model.max_model_len=32000",
                                  "client.request_timeout_s=15", "frontend.enable=false",
                                  "scheduler.async_scheduling=false"]),
    "a100_stages": (A100, ["workload.num_prompts=400", "workload.input_len=600",
                           "workload.output_len=200",
                           ("workload.stages=[{rate: 8, duration_s: 10}, "
                           "{concurrency: 16, num_requests: 100, gap_s: 2}, "
                           "{concurrency: 24, duration_s: 8, grace_s: 1}]"),
                           "workload.warmup={num_requests: 5}"]),
    "a100_stages_no_frontend": (A100, ["workload.num_prompts=300", "workload.input_len=600",
                                       "workload.output_len=200", "frontend.enable=false",
                                       ("workload.stages=[{rate: 20, num_requests: 100}, "
                                       "{concurrency: 32, duration_s: 8, grace_s: 1}]")]),
    # -- clusters ------------------------------------------------------------------------------
    "cluster_prefix_router": (ROOT / "configs" / "cluster_prefix_router_llama8b.yaml",
                              ["workload.num_sessions=120"]),
    "cluster_pd": (ROOT / "configs" / "cluster_pd_llama70b_h100.yaml",
                   ["workload.num_prompts=200"]),
    "a100_cpu_offload": (A100, ["cache.kv_offload={cpu_bytes: 4GiB}", "workload.prefix_len=300",
                                "cache.num_gpu_blocks_override=1500", "model.max_model_len=24000",
                                "workload.request_rate=20"]),
    "sessions_cpu_offload": (None, ["workload.kind=sessions", "workload.num_sessions=80",
                                    "workload.turns=4", "workload.session_rate=4",
                                    "cache.num_gpu_blocks_override=1200", "model.max_model_len=19200",
                                    "cache.kv_offload={cpu_bytes: 8GiB}"]),
    "sessions_cpu_offload_arc_sync": (None, ["workload.kind=sessions", "workload.num_sessions=80",
                                             "workload.turns=4", "workload.session_rate=4",
                                             "cache.num_gpu_blocks_override=1200", "model.max_model_len=19200",
                                             ("cache.kv_offload={cpu_bytes: 1GiB, policy: arc, "
                                             "block_size: 32}"),
                                             "scheduler.async_scheduling=false"]),
    # -- speculative decoding, multi-LoRA -----------------------------------------------------
    "eagle": (ROOT / "configs" / "llama8b_h100_eagle.yaml", []),
    "eagle_small_cache": (ROOT / "configs" / "llama8b_h100_eagle.yaml",
                          ["cache.num_gpu_blocks_override=600", "model.max_model_len=9600",
                           "workload.request_rate=30"]),
    "ngram_sync": (ROOT / "configs" / "llama8b_h100_eagle.yaml",
                   ["speculative_config.method=ngram", "speculative_config.model=null"]),
    "lora": (ROOT / "configs" / "llama8b_h100_lora.yaml", []),
    "lora_small_cache": (ROOT / "configs" / "llama8b_h100_lora.yaml",
                         ["cache.num_gpu_blocks_override=900", "model.max_model_len=14400",
                          "workload.request_rate=20"]),
}


def _trace_hook():
    """Record every replica's per-step schedule (the engine's test trace)."""
    from servesim.simulator import engine

    traces: list[list] = []
    init = engine.Replica.__init__

    def patched(self, *a, **kw):
        init(self, *a, **kw)
        self.scheduler.record_schedules = True
        self.trace = []
        traces.append(self.trace)

    engine.Replica.__init__ = patched
    return traces


def dump(out: Path, names: list[str], trace: bool) -> None:
    from servesim.simulator.config import load_config, resolve_config
    from servesim.simulator.runner import run_experiment

    warnings.simplefilter("ignore")
    traces = _trace_hook() if trace else None
    res = {}
    for name in names:
        path, overrides = CASES[name]
        try:
            cfg = resolve_config(load_config(path, overrides))
        except Exception as e:  # noqa: BLE001 (a case this version cannot express)
            print(f"{name}: skipped ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        if traces is not None:
            traces.clear()
        t0 = time.perf_counter()
        r = run_experiment(cfg, resolved=True)
        wall = time.perf_counter() - t0
        res[name] = _record(r)
        res[name]["trace"] = [list(t) for t in traces] if traces is not None else None
        counters = res[name]["counters"]
        print(f"{name}: {len(r.requests['request_id'])} requests, {counters['num_steps']} steps,"
              f" {counters['num_preemptions']} preemptions, {wall:.2f} s", file=sys.stderr)
    out.write_bytes(pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL))


def _dist(d):
    """(values, counts) of a metrics.Distribution in insertion order (None: absent/sketched)."""
    if d is None or not getattr(d, "exact", False):
        return None
    return d.exact_sample()


def _record(r) -> dict:
    import numpy as np
    from servesim.reports import compute_bench_result

    counters = {k: v for k, v in r.counters.items() if k != "wall_seconds"}
    bench = compute_bench_result(r, date="-")
    bench = {k: v for k, v in bench.items() if k not in ("wall_seconds", "sim_speed")}
    return {
        "requests": {k: np.asarray(v) for k, v in r.requests.items()},
        "steps": {k: np.asarray(v) for k, v in r.steps.items()},
        "counters": counters,
        "itl": (np.asarray(r.itl_values), np.asarray(r.itl_counts)),
        "engine_itl": _dist(getattr(r, "engine_itl", None)),
        "stage_itl": {k: _dist(v) for k, v in (getattr(r, "stage_itl", None) or {}).items()},
        "extras": dict(getattr(r, "extras", {}) or {}),
        "bench": pickle.dumps(bench),
        "instances": [(n, _record(i)) for n, i in getattr(r, "instances", ())],
    }


def _close(a, b, rtol: float) -> bool:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        a, b = a.astype(float), b.astype(float)
        both_nan = np.isnan(a) & np.isnan(b)
        ok = both_nan | (a == b) | (np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b)))
        return bool(ok.all())
    return bool((a == b).all())


def _itl_multiset(values, counts, rtol: float = 1.0) -> dict:
    """ITL samples as {value: count}, values rounded to 12 significant digits (exact values
    with ``rtol`` 0)."""
    out: dict[float, int] = {}
    for v, c in zip(values.tolist(), counts.tolist()):
        k = float(v) if rtol == 0 else float(f"{v:.12g}")
        out[k] = out.get(k, 0) + int(c)
    return out


def _trace_close(ta, tb, rtol: float) -> str | None:
    if len(ta) != len(tb):
        return f"{len(ta)} vs {len(tb)} replicas"
    for rep, (a, b) in enumerate(zip(ta, tb)):
        if len(a) != len(b):
            return f"replica {rep}: {len(a)} vs {len(b)} batches"
        for i, ((t1, s1, p1), (t2, s2, p2)) in enumerate(zip(a, b)):
            if s1 != s2 or p1 != p2 or not (t1 == t2 or math.isclose(
                    t1, t2, rel_tol=rtol, abs_tol=1e-12 if rtol else 0.0)):
                return f"replica {rep} batch {i} at {t1}: {s1}, {p1} vs {t2}: {s2}, {p2}"
    return None


def _problems(x: dict, y: dict, rtol: float, where: str = "") -> list[str]:
    import numpy as np

    problems = []
    for col in x["requests"]:
        if not _close(x["requests"][col], y["requests"].get(col, []), rtol):
            problems.append(f"{where}requests.{col}")
    for col in x["steps"]:
        if not _close(x["steps"][col], y["steps"].get(col, []), rtol):
            problems.append(f"{where}steps.{col}")
    for k, v in x["counters"].items():
        w = y["counters"].get(k)
        if isinstance(v, float) and isinstance(w, float):
            if not (v == w or math.isclose(v, w, rel_tol=rtol)):
                problems.append(f"{where}counters.{k}: {v} vs {w}")
        elif v != w:
            problems.append(f"{where}counters.{k}: {v} vs {w}")
    if _itl_multiset(*x["itl"], rtol) != _itl_multiset(*y["itl"], rtol):
        problems.append(f"{where}itl samples")
    elif rtol == 0 and not (np.array_equal(x["itl"][0], y["itl"][0], equal_nan=True)
                            and np.array_equal(x["itl"][1], y["itl"][1])):
        problems.append(f"{where}itl sample order")
    for key in ("engine_itl",):
        a, b = x.get(key), y.get(key)
        if (a is None) != (b is None) or (a is not None and _itl_multiset(*a, rtol)
                                          != _itl_multiset(*b, rtol)):
            problems.append(f"{where}{key}")
    sa, sb = x.get("stage_itl") or {}, y.get("stage_itl") or {}
    if set(sa) != set(sb) or any(
            (sa[k] is None) != (sb[k] is None)
            or (sa[k] is not None and _itl_multiset(*sa[k], rtol) != _itl_multiset(*sb[k], rtol))
            for k in sa):
        problems.append(f"{where}stage_itl")
    if "extras" in x and x["extras"] != y.get("extras"):
        problems.append(f"{where}extras")
    if rtol == 0 and "bench" in x and x["bench"] != y.get("bench"):
        ba, bb = pickle.loads(x["bench"]), pickle.loads(y["bench"])
        keys = sorted(k for k in set(ba) | set(bb) if repr(ba.get(k)) != repr(bb.get(k)))
        problems.append(f"{where}result.json keys {keys[:8]}")
    ia, ib = x.get("instances") or [], y.get("instances") or []
    if [n for n, _ in ia] != [n for n, _ in ib]:
        problems.append(f"{where}instances")
    else:
        for (n, xa), (_, yb) in zip(ia, ib):
            problems += _problems(xa, yb, rtol, f"{where}{n}.")
    return problems


def compare(a_path: Path, b_path: Path, rtol: float) -> int:
    a = pickle.loads(a_path.read_bytes())
    b = pickle.loads(b_path.read_bytes())
    bad = 0
    for name in a:
        if name not in b:
            print(f"{name}: missing in {b_path}")
            bad += 1
            continue
        x, y = a[name], b[name]
        problems = _problems(x, y, rtol)
        if x["trace"] is not None and y["trace"] is not None:
            why = _trace_close(x["trace"], y["trace"], rtol)
            if why:
                problems.append(f"schedule trace: {why}")
        n = len(x["requests"]["request_id"])
        steps = x["counters"]["num_steps"]
        steps = f"{steps} steps, {x['counters']['num_preemptions']} preemptions"
        traced = " + schedules" if x["trace"] is not None and y["trace"] is not None else ""
        if problems:
            bad += 1
            print(f"{name}: DIFFERENT ({n} requests, {steps}): {'; '.join(problems)}")
        else:
            print(f"{name}: identical ({n} requests, {steps}; records{traced}, "
                  f"rtol {rtol:g})")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("cases", nargs="*", default=list(CASES))
    d.add_argument("--trace", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--rtol", type=float, default=1e-9)
    args = ap.parse_args()
    if args.cmd == "dump":
        dump(args.out, args.cases, args.trace)
    else:
        sys.exit(compare(args.a, args.b, args.rtol))


if __name__ == "__main__":
    main()
