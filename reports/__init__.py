"""Result files of a run (vLLM bench schema), console summary; later plots, reports, A/B.

The names below load on first use (start-up time: ``simulate run`` imports
``reports.writers`` before simulating and the rest only when writing)."""

__all__ = ["VLLM_BENCH_KEYS", "compute_bench_result", "print_summary", "write_run"]

_WHERE = {
    "VLLM_BENCH_KEYS": "servesim.reports.bench_result",
    "compute_bench_result": "servesim.reports.bench_result",
    "print_summary": "servesim.reports.console",
    "write_run": "servesim.reports.writers",
}


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
