"""The ``run`` fixture of the metric oracles: one simulated scenario per parameter."""

from __future__ import annotations

import pytest
from metric_oracle import SCENARIOS, Run


# Function-scoped on purpose: every test derives and writes its run's reports itself, so
# mutation testing (which runs, per mutant, only the tests that executed the mutated function)
# sees each check; the simulation behind it is cached (see simulate).
@pytest.fixture(params=list(SCENARIOS))
def run(request, tmp_path) -> Run:
    return Run(request.param, SCENARIOS[request.param], tmp_path)
