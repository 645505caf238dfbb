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


def batch_shapes():
    """Hypothesis strategy: random engine-step batches (decode rows, up to 3 prefill chunks)."""
    from hypothesis import strategies as st

    return st.builds(
        lambda nd, ctx, chunks, sampled_extra: BatchShape(
            num_decode=nd, decode_context_sum=nd * ctx, decode_context_max=ctx if nd else 0,
            prefill_new_tokens=tuple(c for c, _ in chunks),
            prefill_context=tuple(p for _, p in chunks),
            num_sampled=nd + min(sampled_extra, len(chunks))),
        st.integers(0, 300), st.integers(1, 20000),
        st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 20000)), max_size=3),
        st.integers(0, 3),
    ).filter(lambda b: b.num_tokens > 0)
