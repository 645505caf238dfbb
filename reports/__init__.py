"""Result files of a run (vLLM bench schema), console summary; later plots, reports, A/B."""

from servesim.reports.bench_result import VLLM_BENCH_KEYS, compute_bench_result
from servesim.reports.console import print_summary
from servesim.reports.writers import write_run

__all__ = ["VLLM_BENCH_KEYS", "compute_bench_result", "print_summary", "write_run"]
