"""Shared helpers for the reliability tests (issue 16)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "llama8b_a100.yaml"


@pytest.fixture
def small_config(tmp_path) -> Path:
    """A copy of the shipped example with a 40-request workload (runs in well under 1 s)."""
    p = tmp_path / "small.yaml"
    p.write_text(CONFIG.read_text().replace("num_prompts: 1000", "num_prompts: 40"))
    return p
