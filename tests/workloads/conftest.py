"""Shared fixtures: tiny trace files with the exact headers, written per test."""

from pathlib import Path

import pytest

# /work/shared/traces next to the repository (absent in a fresh clone: tests skip)
SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


@pytest.fixture
def write(tmp_path):
    def _write(name: str, text: str) -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return _write
