"""Scale-out through Ray: the small sweep and plan of conftest.py run as Ray tasks on a local
Ray cluster, reached by its address like a remote one (``--ray-address``), give results
identical to the single-process run; the driver writes every point file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from servesim.simulator.plan import load_plan, run_plan
from servesim.simulator.sweep import load_spec, run_sweep

ray = pytest.importorskip("ray", reason="ray is not installed")


@pytest.fixture(scope="module")
def cluster_address():
    from ray.cluster_utils import Cluster

    try:
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={"num_cpus": 2, "include_dashboard": False})
    except Exception as e:  # noqa: BLE001 -- e.g. a sandbox without the ports Ray needs
        pytest.skip(f"a local Ray cluster cannot start here: {e}")
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def _no_date(p: Path) -> dict:
    return {k: v for k, v in json.loads(p.read_text()).items() if k != "date"}


def _same_points(a: Path, b: Path) -> None:
    runs = sorted(p.relative_to(a) for p in a.glob("SERVE-*/run=*.json"))
    assert runs and runs == sorted(p.relative_to(b) for p in b.glob("SERVE-*/run=*.json"))
    for rel in runs:
        assert _no_date(a / rel) == _no_date(b / rel), rel


def test_sweep_on_a_ray_cluster(cluster_address, sweep_file, sweep_reference, tmp_path):
    res = run_sweep(load_spec(sweep_file), tmp_path, backend="ray", ray_address=cluster_address)
    assert not ray.is_initialized()  # the sweep disconnected from the cluster it joined
    assert res.num_run == 12 and res.num_failed == 0
    for name in ("summary.csv", "ab.csv"):
        assert (res.exp_dir / name).read_bytes() == (sweep_reference / name).read_bytes()
    _same_points(sweep_reference, res.exp_dir)


def test_plan_on_a_ray_cluster(cluster_address, plan_file, plan_reference, tmp_path,
                               monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", cluster_address)  # the environment way to name it
    spec, plan_dir = load_plan(plan_file)
    res = run_plan(spec, plan_dir, tmp_path, backend="ray", quiet=True, write_report=False)
    assert not ray.is_initialized()
    assert res["backend"] == "ray"
    assert (tmp_path / "plan.csv").read_bytes() == (plan_reference / "plan.csv").read_bytes()
    assert _plan_json(tmp_path) == _plan_json(plan_reference)
    _same_points(plan_reference / "points", tmp_path / "points")


def _plan_json(d: Path) -> dict:
    return {k: v for k, v in json.loads((d / "plan.json").read_text()).items()
            if k not in ("wall_seconds", "jobs", "backend")}
