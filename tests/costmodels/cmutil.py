"""Helpers shared by the cost-model tests."""

from __future__ import annotations

from pathlib import Path

from servesim.costmodels.batch import BatchShape

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]


def make_cfg(*overrides: str, resolve: bool = True):
    """An ExperimentConfig from --set style overrides (resolved like the CLI does)."""
    from servesim.simulator.config import load_config, resolve_config

    cfg = load_config(None, list(overrides))
    return resolve_config(cfg) if resolve else cfg


def decode(batch: int, context: int) -> BatchShape:
    """``batch`` decode rows, each attending ``context`` tokens."""
    return BatchShape(num_decode=batch, decode_context_sum=batch * context,
                      decode_context_max=context, num_sampled=batch)


def prefill(chunk: int, context: int = 0, sampled: int = 1) -> BatchShape:
    return BatchShape(prefill_new_tokens=(chunk,), prefill_context=(context,),
                      num_sampled=sampled)
