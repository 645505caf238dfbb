"""An overloaded replay keeps the arrived-but-waiting tail in compact columns (client.Parked)
instead of Request objects (defect 12: bounded memory). Parking must change no decision:
the same run with and without it writes byte-identical requests.csv and timeseries.csv."""

from __future__ import annotations

import pytest
from servesim.reports import write_run
from servesim.simulator import runner
from servesim.simulator.client import Parked
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment
from servesim.workloads.schema import RequestSpec

from .conftest import CONFIG

CASES = {
    "overload": [],
    "preemptions": ["cache.num_gpu_blocks_override=600", "workload.output_len=600"],
    "pipeline": ["parallel.pipeline_parallel_size=2"],
    "concurrency_prefix": ["workload.max_concurrency=700", "workload.prefix_len=512"],
    "small_seqs": ["scheduler.max_num_seqs=8"],
    "client_queue": ["workload.max_concurrency=40"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parking_changes_nothing(case, monkeypatch, tmp_path):
    ov = ["workload.num_prompts=1500", "workload.request_rate=60", *CASES[case]]
    cfg = resolve_config(load_config(CONFIG, ov))
    monkeypatch.setattr(runner, "PARK_AFTER", 0)
    monkeypatch.setattr(runner, "PARK_AFTER_SEQS", 1)
    parked_calls = []
    orig = Parked.push

    def spy(self, spec, t):
        parked_calls.append(t)
        orig(self, spec, t)

    monkeypatch.setattr(Parked, "push", spy)
    write_run(run_experiment(cfg, resolved=True), tmp_path / "parked", date="20260101-000000")
    assert len(parked_calls) > 100  # the case really overloads the engine
    monkeypatch.setattr(runner, "_park_after", lambda cfg, n: None)
    write_run(run_experiment(cfg, resolved=True), tmp_path / "plain", date="20260101-000000")
    for name in ("requests.csv", "timeseries.csv", "result.json"):
        assert ((tmp_path / "parked" / name).read_bytes()
                == (tmp_path / "plain" / name).read_bytes()), name


def test_parked_round_trip_keeps_specs():
    p = Parked()
    ids = (1, 2, 3)
    plain = RequestSpec(arrival_s=0.5, prompt_len=10, output_len=3, request_id="0",
                        prefix_block_ids=ids, extra={"_index": 0})
    odd = RequestSpec(arrival_s=0.7, prompt_len=11, output_len=4, request_id="x",
                      priority=2, extra={"_index": 1})
    p.push(plain, 0.5)
    p.push(odd, 0.9)
    assert len(p) == 2 and p.special == {1: odd}
    a, ta = p.pop()
    b, tb = p.pop()
    assert (a.arrival_s, a.prompt_len, a.output_len, a.request_id, a.prefix_block_ids,
            a.extra, ta) == (0.5, 10, 3, "0", ids, {"_index": 0}, 0.5)
    assert b is odd and tb == 0.9 and len(p) == 0


def test_compact_tokenizer_queue_changes_nothing(monkeypatch, tmp_path):
    """A burst sent at once waits for the API server's tokenizer in compact columns past
    ``_Ingress.SHORT`` (65,536 normally): the same run with the columns from the 5th request
    on writes byte-identical files."""
    from servesim.simulator import frontend

    cfg = resolve_config(load_config(CONFIG, ["workload.num_prompts=600",
                                              "workload.request_rate=inf"]))
    write_run(run_experiment(cfg, resolved=True), tmp_path / "plain", date="20260101-000000")
    pushed = []
    orig = Parked.push

    def spy(self, spec, t):
        pushed.append(t)
        orig(self, spec, t)

    monkeypatch.setattr(frontend._Ingress, "SHORT", 4)
    monkeypatch.setattr(Parked, "push", spy)
    write_run(run_experiment(cfg, resolved=True), tmp_path / "compact", date="20260101-000000")
    assert len(pushed) > 500  # the tail really waited in columns
    for name in ("requests.csv", "timeseries.csv", "result.json"):
        assert ((tmp_path / "compact" / name).read_bytes()
                == (tmp_path / "plain" / name).read_bytes()), name
