"""The "Serving Benchmark Result" block of ``vllm bench serve``, for a bench dict."""

from __future__ import annotations

from typing import Any

from servesim.reports.bench_result import metrics_in

WIDTH = 50


def _row(name: str, value: Any, fmt: str = "") -> str:
    """``"{:<40} {:<10}"`` / ``"{:<40} {:<10.2f}"`` rows; None → ``"n/a"``."""
    if value is None:
        return "{:<40} {:<10}".format(name, "n/a")
    return ("{:<40} {:<10" + fmt + "}").format(name, value)


def summary_lines(bench: dict) -> list[str]:
    """The lines ``print_summary`` prints (vLLM's labels and formats, then servesim's)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="=")]
    lines.append(_row("Successful requests:", bench.get("completed")))
    lines.append(_row("Failed requests:", bench.get("failed")))
    if bench.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", bench["max_concurrency"]))
    rate = bench.get("request_rate")
    if rate is not None and rate != "inf":
        lines.append(_row("Request rate configured (RPS):", rate, ".2f"))
    lines.append(_row("Benchmark duration (s):", bench.get("duration"), ".2f"))
    lines.append(_row("Total input tokens:", bench.get("total_input_tokens")))
    lines.append(_row("Total generated tokens:", bench.get("total_output_tokens")))
    lines.append(_row("Request throughput (req/s):", bench.get("request_throughput"), ".2f"))
    if bench.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", bench["request_goodput"], ".2f"))
    lines.append(_row("Output token throughput (tok/s):", bench.get("output_throughput"), ".2f"))
    if "max_output_tokens_per_s" in bench:
        lines.append(
            _row("Peak output token throughput (tok/s):", bench["max_output_tokens_per_s"], ".2f")
        )
    if "max_concurrent_requests" in bench:
        lines.append(_row("Peak concurrent requests:", bench["max_concurrent_requests"], ".2f"))
    lines.append(
        _row("Total Token throughput (tok/s):", bench.get("total_token_throughput"), ".2f")
    )
    for metric, name, header, words in metrics_in(bench):
        lines.append("{s:{c}^{n}}".format(s=header, n=WIDTH, c="-"))
        lines.append(_row(f"Mean {name} (ms):", bench.get(f"mean_{metric}_ms"), ".2f"))
        lines.append(_row(f"Median {name} (ms):", bench.get(f"median_{metric}_ms"), ".2f"))
        for w in words:
            lines.append(_row(f"P{w} {name} (ms):", bench.get(f"p{w}_{metric}_ms"), ".2f"))
    if "spec_decode_acceptance_rate" in bench:  # vLLM's "Speculative Decoding" block
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=WIDTH, c="-"))
        lines.append(_row("Acceptance rate (%):", bench["spec_decode_acceptance_rate"], ".2f"))
        lines.append(_row("Acceptance length:", bench["spec_decode_acceptance_length"], ".2f"))
        lines.append(_row("Drafts:", bench["spec_decode_num_drafts"]))
        lines.append(_row("Draft tokens:", bench["spec_decode_draft_tokens"]))
        lines.append(_row("Accepted tokens:", bench["spec_decode_accepted_tokens"]))
        per_pos = bench.get("spec_decode_per_position_acceptance_rates") or []
        if per_pos:
            lines.append("Per-position acceptance (%):")
            for i, rate in enumerate(per_pos):
                lines.append(_row(f"  Position {i}:", rate * 100, ".2f"))
    if "mean_engine_ttft_ms" in bench:
        lines.append("{s:{c}^{n}}".format(s="Engine side (vLLM Prometheus)", n=WIDTH, c="-"))
        for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"),
                         ("queue_time", "queue time"), ("prefill_time", "prefill time")):
            key = f"mean_engine_{m}_ms"
            if key in bench:
                lines.append(_row(f"Mean engine {label} (ms):", bench[key], ".2f"))
    bd = bench.get("ttft_breakdown_ms") or {}
    if bd and (bench.get("frontend") or {}).get("enable"):
        from servesim.reports.bench_result import TTFT_TERMS

        lines.append("{s:{c}^{n}}".format(s="Mean TTFT breakdown", n=WIDTH, c="-"))
        labels = {"ipc_in": "ipc in + input queue"}  # (the engine loop takes it in later)
        for name, _, _, _ in TTFT_TERMS:
            label = labels.get(name, name.replace("_", " "))
            lines.append(_row(f"  {label} (ms):", bd.get(name), ".3f"))
        fe = bench["frontend"]
        p = fe.get("params") or {}
        lines.append(_row("API servers:", fe.get("api_server_count")))
        lines.append(_row("  request work (ms):", 1e3 * p.get("request_s", 0), ".3f"))
        lines.append(_row("  tokenize per token (us):",
                          1e6 * p.get("tokenize_per_token_s", 0), ".3f"))
        lines.append(_row("  tokenizer batch window (ms):",
                          1e3 * p.get("tokenizer_batch_wait_s", 0), ".3f"))
        lines.append(_row("  IPC hop, each way (ms):", 1e3 * p.get("ipc_s", 0), ".3f"))
        lines.append(_row("  detokenize+SSE per token (us):",
                          1e6 * p.get("detokenize_per_token_s", 0), ".3f"))
        if fe.get("stream_interval"):
            lines.append(_row("  stream interval (tokens):", fe["stream_interval"]))
            lines.append(_row("  of which SSE, per chunk (us):",
                              1e6 * p.get("stream_chunk_s", 0), ".3f"))
    if bench.get("simulated"):
        lines.append("{s:{c}^{n}}".format(s="servesim", n=WIDTH, c="-"))
        lines.append(_row("GPU KV cache blocks:", bench.get("num_gpu_blocks")))
        lines.append(_row("Preemptions:", bench.get("num_preemptions")))
        hit = bench.get("prefix_cache_hit_rate")
        lines.append(_row("Prefix cache hit rate (%):", None if hit is None else 100 * hit, ".2f"))
        if bench.get("max_loras") is not None:
            lines.append(_row("LoRA adapters seen / max_loras:",
                              f"{bench.get('lora_adapters_seen')} / {bench['max_loras']}"))
            lines.append(_row("LoRA loads (CPU→GPU / disk):",
                              f"{bench.get('lora_loads_from_cpu')} / "
                              f"{bench.get('lora_loads_from_disk')}"))
        lines.append(_row("Simulation speed (sim s / wall s):", bench.get("sim_speed"), ".1f"))
    lines.append("=" * WIDTH)
    return lines


def print_summary(bench: dict, console: Any = None) -> None:
    """Print the summary to a rich ``Console`` (default: a new one on stdout) or a text stream."""
    if console is None:
        from rich.console import Console

        console = Console()
    for line in summary_lines(bench):
        if hasattr(console, "print"):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:  # a plain text stream
            console.write(line + "\n")


def print_table(table: Any, console: Any = None) -> None:
    """Print a rich ``Table`` without losing a column or a digit.

    On a terminal the table fits the width and cells fold (wrap, breaking long words) where
    they must; piped or redirected, it is printed at its natural width (no wrapping at all),
    so scripts and files get whole rows."""
    from rich.console import Console

    console = console or Console()
    for col in table.columns:
        col.overflow = "fold"
        col.no_wrap = False
    if not console.is_terminal:
        need = console.measure(table, options=console.options.update(width=10_000)).maximum
        if need > console.width:
            console = Console(width=need, file=console.file, no_color=console.no_color,
                              force_terminal=False)
    console.print(table)
