"""``simulate estimate``: one step's predicted time, per operator, with provenance."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

CONFIG_ARG = typer.Argument(..., help="Experiment config YAML (e.g. configs/llama8b_a100.yaml)")
SET_OPT = typer.Option(None, "--set", help="Override a config key: section.key=value (repeatable)")


def _si(x: float, unit: str = "") -> str:
    """1.23e9 → '1.23 G<unit>'."""
    if x == 0:
        return "0"
    for f, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= f:
            return f"{x / f:.3g} {p}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _time(s: float) -> str:
    """Seconds → 'x.xxx ms' or 'x.x us'."""
    return f"{s * 1e3:.3f} ms" if abs(s) >= 1e-3 else f"{s * 1e6:.1f} us"


def make_batch(batch_size: int, context: int, prefill_tokens: int = 0,
               prefill_context: int = 0, num_spec_tokens: int = 0):
    """``batch_size`` decode rows each attending ``context`` tokens, plus one prefill chunk of
    ``prefill_tokens`` new tokens after ``prefill_context`` cached ones (it samples a token).
    With speculative decoding each decode row also verifies ``num_spec_tokens`` drafts."""
    from servesim.costmodels.batch import BatchShape

    pre = (prefill_tokens,) if prefill_tokens > 0 else ()
    return BatchShape(
        num_decode=batch_size,
        decode_context_sum=batch_size * context,
        decode_context_max=context if batch_size else 0,
        prefill_new_tokens=pre,
        prefill_context=(prefill_context,) if pre else (),
        num_sampled=batch_size * (1 + num_spec_tokens) + (1 if pre else 0),
        num_spec_tokens=batch_size * num_spec_tokens,
    )


def check_shape(cfg, plan, batch_size: int, context: int, prefill_tokens: int = 0,
                prefill_context: int = 0) -> str | None:
    """Refuse (ConfigError) a step vLLM could never schedule: more sequences than
    ``scheduler.max_num_seqs``, a row longer than ``model.max_model_len``. Returns a warning
    when the rows need more KV-cache blocks than ``plan`` (the memory plan) has (vLLM would
    preempt some of them first), else None."""
    from servesim.simulator.errors import ConfigError

    seqs = batch_size + (1 if prefill_tokens else 0)
    max_seqs = cfg.scheduler.max_num_seqs
    if max_seqs is not None and seqs > max_seqs:
        what = "--batch-size + the prefill" if prefill_tokens else "--batch-size"
        raise ConfigError(f"estimate: {seqs} sequences ({what}) exceed scheduler.max_num_seqs "
                          f"({max_seqs}); vLLM never schedules more in one step")
    mml = plan.max_model_len
    if batch_size and context > mml:
        raise ConfigError(f"estimate: --context {context} is longer than model.max_model_len "
                          f"({mml})")
    if prefill_tokens and prefill_context + prefill_tokens > mml:
        raise ConfigError(f"estimate: --prefill-context + --prefill-tokens "
                          f"({prefill_context + prefill_tokens}) is longer than "
                          f"model.max_model_len ({mml})")
    bs = plan.block_size
    blocks = batch_size * -(-context // bs) + (-(-(prefill_context + prefill_tokens) // bs)
                                               if prefill_tokens else 0)
    if blocks > plan.num_gpu_blocks:
        return (f"estimate: the batch needs {blocks:,} KV-cache blocks, more than the "
                f"{plan.num_gpu_blocks:,} the cache holds (vLLM would preempt requests first)")
    return None


def _load(config: Path, overrides: list[str]):
    from servesim.simulator.config import load_config

    cfg = load_config(config, overrides)
    try:
        from servesim.simulator.config import resolve_config
    except ImportError:  # older simulator: the cost model fills vLLM's defaults itself
        return cfg
    return resolve_config(cfg)


def estimate(
    config: Path = CONFIG_ARG,
    batch_size: int = typer.Option(..., "--batch-size", min=0, help="Decode rows in the step"),
    context: int = typer.Option(..., "--context", min=1,
                                help="Context tokens each decode row attends to"),
    prefill_tokens: int = typer.Option(0, "--prefill-tokens", min=0,
                                       help="New tokens of one prefill chunk in the step"),
    prefill_context: int = typer.Option(0, "--prefill-context", min=0,
                                        help="Tokens already cached before that chunk"),
    overrides: Optional[list[str]] = SET_OPT,  # noqa: UP045 (typer needs Optional)
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table"),
) -> None:
    """Predict one engine step's time for a batch shape: per-op table (totals over all layers)."""
    import json
    import warnings

    from servesim.costmodels import plan_memory
    from servesim.costmodels.step import build_cost_model
    from servesim.simulator.errors import ConfigError, in_file

    if batch_size == 0 and prefill_tokens == 0:
        raise ConfigError("estimate: give --batch-size > 0 or --prefill-tokens > 0")
    cfg = _load(config, list(overrides or []))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_cost_model(cfg)
        with in_file(config):  # CapacityError when the model does not fit, as in validate
            plan = plan_memory(cfg)
    for w in caught:  # one line each on stderr
        typer.echo(f"warning: {w.message}", err=True)
    kv_warning = check_shape(cfg, plan, batch_size, context, prefill_tokens, prefill_context)
    if kv_warning:
        typer.echo(f"warning: {kv_warning}", err=True)
    sc = getattr(cfg, "speculative_config", None)  # decode rows verify k drafts each
    k = sc.num_speculative_tokens if sc is not None else 0
    batch = make_batch(batch_size, context, prefill_tokens, prefill_context, k)
    st = model.step_time(batch)
    from servesim.costmodels.power import sustained_step_seconds

    sustained = sustained_step_seconds(model, batch)
    if as_json:
        out = {
            "step_seconds": st.seconds,
            "sustained_step_seconds": sustained,
            "gpu_seconds": st.gpu_seconds,
            "host_seconds": st.host_seconds,
            "cudagraph": st.cudagraph,
            "padded_batch": st.padded_batch,
            "ops": [{"name": o.name, "count": o.count, "seconds": o.seconds, "flops": o.flops,
                     "bytes": o.bytes, "bound": o.bound, "efficiency": o.efficiency,
                     "provenance": o.provenance} for o in st.breakdown],
        }
        typer.echo(json.dumps(out, indent=2))
        return

    from rich.console import Console
    from rich.table import Table

    spec, hw = model.spec, model.hw
    cal = _calibration_title(model.calibration)
    title = (f"{spec.name} on {hw.name} · TP={model.tp} PP={model.pp} · weights "
             f"{model.weight_format.name} · KV {cfg.cache.cache_dtype} · "
             f"{batch.num_decode} decode @ {context} ctx"
             + (f" (+{k} drafts each)" if k else "")
             + (f" + prefill {prefill_tokens} @ {prefill_context}" if prefill_tokens else "")
             + f" · cudagraph {st.cudagraph} (padded to {st.padded_batch}) · calibration {cal}")
    t = Table(title=title, title_justify="left")
    for col, just in (("op", "left"), ("count", "right"), ("time", "right"), ("share", "right"),
                      ("FLOPs", "right"), ("bytes", "right"), ("bound", "left"),
                      ("eff", "right"), ("provenance", "left")):
        t.add_column(col, justify=just, no_wrap=True)
    for o in st.breakdown:
        share = o.seconds / st.seconds if st.seconds else 0.0
        t.add_row(o.name, str(o.count), _time(o.seconds), f"{share:.1%}", _si(o.flops),
                  _si(o.bytes, "B"), o.bound, f"{o.efficiency:.2f}", o.provenance)
    t.add_section()
    t.add_row("total", "", _time(st.seconds), "100.0%",
              _si(sum(o.flops for o in st.breakdown)), _si(sum(o.bytes for o in st.breakdown),
                                                          "B"), "", "", "")
    from servesim.reports.console import print_table

    con = Console()
    print_table(t, con)  # folds on a narrow terminal, full width when piped
    tok = batch.num_decode + prefill_tokens
    con.print(f"step {st.seconds * 1e3:.3f} ms = GPU {st.gpu_seconds * 1e3:.3f} ms + exposed host "
              f"{(st.seconds - st.gpu_seconds) * 1e3:.3f} ms (async_scheduling="
              f"{model.async_scheduling}); {tok / st.seconds:,.0f} tokens/s")
    if sustained is not None and sustained > st.seconds:
        con.print(f"back to back: {sustained * 1e3:.3f} ms a step, "
                  f"+{sustained / st.seconds - 1:.1%} ({tok / sustained:,.0f} tokens/s): the "
                  f"{hw.name}'s power cap slows the step's "
                  f"{model.compute_seconds(batch) * 1e3:.3f} ms of compute-bound work "
                  "(costmodels/power.py)")


def _calibration_title(cal) -> str:
    """'<files> (<where the numbers come from>)' or 'none (default efficiencies)'."""
    if cal is None:
        return "none (default efficiencies)"
    src = cal.source or {}
    if src.get("kind") == "aiconfigurator":
        return (f"{' + '.join(p.name for p in cal.paths)} (aiconfigurator-core "
                f"{src.get('package_version')}, measured by NVIDIA)")
    return " + ".join(str(p) for p in cal.paths)


def register(app: typer.Typer) -> None:
    """Add this concern's commands to ``app``."""
    app.command("estimate")(estimate)
