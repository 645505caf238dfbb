"""Scale-out through Ray: the small sweep and plan of conftest.py run as Ray tasks on a local
Ray cluster, reached by its address like a remote one (``--ray-address``), give results
identical to the single-process run; the driver writes every point file."""

from __future__ import annotations

import pytest
from same import assert_same_results
from servesim.simulator.plan import load_plan
from servesim.simulator.plan.runner import run_plan
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


def test_sweep_on_a_ray_cluster(cluster_address, sweep_file, sweep_reference, tmp_path):
    res = run_sweep(load_spec(sweep_file), tmp_path, backend="ray", ray_address=cluster_address)
    assert not ray.is_initialized()  # the sweep disconnected from the cluster it joined
    assert res.num_run == 12 and res.num_failed == 0
    assert_same_results("sweep", sweep_reference, tmp_path)


def test_plan_on_a_ray_cluster(cluster_address, plan_file, plan_reference, tmp_path,
                               monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", cluster_address)  # the environment way to name it
    spec, plan_dir = load_plan(plan_file)
    res = run_plan(spec, plan_dir, tmp_path, backend="ray", quiet=True, write_report=False)
    assert not ray.is_initialized()
    assert res["backend"] == "ray"
    assert_same_results("plan", plan_reference, tmp_path)


def test_an_unreachable_ray_address_fails_at_once(sweep_file, tmp_path):
    """A host:port nothing listens on: a one-line error from a TCP check before ray.init
    (which retries such an address for minutes)."""
    import socket

    from servesim.simulator.errors import ServesimError

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # (free again: connections to it are refused)
    with pytest.raises(ServesimError, match=f"cannot connect to Ray at 127.0.0.1:{port} "):
        run_sweep(load_spec(sweep_file), tmp_path, backend="ray",
                  ray_address=f"127.0.0.1:{port}")
