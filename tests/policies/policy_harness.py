"""Step-by-step driver for policy tests: the simulator tests' harness, with steps as dicts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulator"))

from harness import Harness


class PolicyHarness(Harness):
    def __init__(self, policy="fcfs", allocator="paged", **kw):
        super().__init__(policy=policy, allocator=allocator, **kw)

    def step(self, dt=1.0) -> dict:
        return super().step(dt).as_dict()
