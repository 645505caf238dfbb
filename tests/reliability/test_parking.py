"""An overloaded replay keeps the arrived-but-waiting tail in compact columns (client.Parked)
instead of Request objects (defect 12: bounded memory). Parking must change no decision:
the same run with and without it writes byte-identical requests.csv and timeseries.csv."""

from __future__ import annotations

import math

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
    "preemptions": ["cache.num_gpu_blocks_override=600", "model.max_model_len=8192", "workload.output_len=600"],
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

    def spy(self, spec, t, *q):
        parked_calls.append(t)
        orig(self, spec, t, *q)

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
    p.push(odd, 0.9, 1.25)  # (with its QUEUED time: parked behind the engine's queue)
    assert len(p) == 2 and p.special == {1: odd}
    a, ta, qa = p.pop()
    b, tb, qb = p.pop()
    assert (a.arrival_s, a.prompt_len, a.output_len, a.request_id, a.prefix_block_ids,
            a.extra, ta) == (0.5, 10, 3, "0", ids, {"_index": 0}, 0.5)
    assert math.isnan(qa) and qb == 1.25
    assert b is odd and tb == 0.9 and len(p) == 0


def test_parked_keeps_values_past_int32_as_objects():
    """The columns hold index and lengths as int32 (29 bytes a request); a spec with a larger
    one is kept whole, in its place in the FIFO."""
    p = Parked()
    big = 2**31  # one past int32
    specs = [RequestSpec(arrival_s=1.0, prompt_len=5, output_len=2, request_id="7",
                         extra={"_index": 7}),
             RequestSpec(arrival_s=1.5, prompt_len=big, output_len=2, request_id="8",
                         extra={"_index": 8}),
             RequestSpec(arrival_s=2.0, prompt_len=6, output_len=3, request_id=str(big),
                         extra={"_index": big}),
             RequestSpec(arrival_s=2.5, prompt_len=2**31 - 1, output_len=2**31 - 1,
                         request_id="9", extra={"_index": 9})]
    for k, s in enumerate(specs):
        p.push(s, 10.0 + k)
    assert sorted(p.special) == [1, 2] and p.index.itemsize == 4
    out = [p.pop() for _ in specs]
    assert [t for _, t, _ in out] == [10.0, 11.0, 12.0, 13.0]
    assert out[1][0] is specs[1] and out[2][0] is specs[2]
    for k in (0, 3):
        s = out[k][0]
        assert (s.arrival_s, s.prompt_len, s.output_len, s.request_id, s.extra) == (
            specs[k].arrival_s, specs[k].prompt_len, specs[k].output_len,
            specs[k].request_id, specs[k].extra)


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

    def spy(self, spec, t, *q):
        pushed.append(t)
        orig(self, spec, t, *q)

    monkeypatch.setattr(frontend._Ingress, "SHORT", 4)
    monkeypatch.setattr(Parked, "push", spy)
    write_run(run_experiment(cfg, resolved=True), tmp_path / "compact", date="20260101-000000")
    assert len(pushed) > 500  # the tail really waited in columns
    for name in ("requests.csv", "timeseries.csv", "result.json"):
        assert ((tmp_path / "compact" / name).read_bytes()
                == (tmp_path / "plain" / name).read_bytes()), name
