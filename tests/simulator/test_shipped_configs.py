"""Every shipped experiment config validates (resolves, fits in memory) and runs."""

from pathlib import Path

import pytest
from servesim.costmodels import plan_memory
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")
                 if p.name != "prices.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_validates_and_runs(path):
    kind = (load_config(path).workload.kind)
    small = "workload.num_sessions=10" if kind == "sessions" else "workload.num_prompts=40"
    cfg = resolve_config(load_config(path, [small]))
    assert plan_memory(cfg).num_gpu_blocks > 0
    r = run_experiment(cfg, resolved=True)
    assert (r.requests["finished_reason"] != "rejected").all()


def test_every_python_folder_is_in_the_wheel():
    """A non-editable install (``pip install .``, a Ray worker's) ships only the packages that
    pyproject lists: every folder with an ``__init__.py`` under a mapped top-level folder must
    be one (``simulator/cluster`` was missing, so cluster configs failed outside editable
    installs)."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {name + "".join("." + part for part in init.parent.relative_to(root / folder).parts)
             for name, folder in setup["package-dir"].items()
             for init in (root / folder).rglob("__init__.py")}
    assert sorted(found - set(setup["packages"])) == []
    assert "servesim.simulator.cluster" in found
