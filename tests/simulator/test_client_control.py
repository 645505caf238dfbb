"""Client behaviour beyond vllm bench: request timeouts (vLLM's abort path), retries, load
stages (open and closed loop, drain barriers, cancellation), warm-up."""

import math

import numpy as np
import pytest
import simpy
from servesim.simulator.client import Client
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.engine import Replica
from servesim.simulator.kv_cache import KVCacheManager
from servesim.simulator.recorder import Recorder
from servesim.simulator.request import Request, RequestStatus
from servesim.simulator.runner import run_experiment
from servesim.simulator.scheduler import Scheduler, SchedulerParams
from servesim.workloads.schema import RequestSpec


def _engine(num_blocks=200, step=0.01, fast_path=True, async_scheduling=False, seqs=8,
            budget=512):
    """One replica (``step``: seconds per step, or a function of the batch shape) whose
    finishes go to the client put in ``box``."""
    env = simpy.Environment()
    kv = KVCacheManager(num_blocks, 16, True, 4096)
    sched = Scheduler(SchedulerParams(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                      max_model_len=4096, block_size=16,
                                      async_scheduling=async_scheduling), kv,
                      fast_path=fast_path)
    rec = Recorder()
    box = []
    step_seconds = step if callable(step) else (lambda shape: step)
    rep = Replica(env, sched, step_seconds, rec, lambda r: box[0].on_finish(r),
                  async_scheduling=async_scheduling)
    return env, kv, sched, rec, rep, box


@pytest.mark.parametrize("fast_path", [True, False])
def test_timeout_aborts_a_request_mid_decode_and_frees_its_blocks(fast_path):
    env, kv, sched, rec, rep, box = _engine(fast_path=fast_path)
    specs = [RequestSpec(arrival_s=0.0, prompt_len=100, output_len=1000, request_id="slow"),
             RequestSpec(arrival_s=0.0, prompt_len=50, output_len=5, request_id="quick")]
    client = Client(env, specs, [rep], rec, max_model_len=4096, num_gpu_blocks=200,
                    block_size=16, max_concurrency=None,
                    control={"request_timeout_s": 1.0})
    box.append(client)
    seen = {}

    def probe():  # just before the timeout: the slow request is decoding and holds blocks
        yield env.timeout(0.995)
        slow = next(r for r in sched.running if r.request_id == "slow")
        seen["blocks"] = len(slow.blocks)
        seen["used"] = kv.get_num_free_blocks()

    env.process(probe())
    env.run()
    client.finalize()
    rec.flush()
    rows = rec.log.all_rows()
    by_id = dict(zip(rows["request_id"].tolist(), range(len(rows["request_id"]))))
    i = by_id["slow"]
    assert rows["finished_reason"][i] == "timeout"
    assert "timed out after 1 s" in rows["error"][i]
    assert rows["finish_s"][i] == pytest.approx(1.0)
    assert 0 < seen["blocks"]
    assert 10 < rows["output_len"][i] < 1000  # it was decoding when it was aborted
    assert rows["finished_reason"][by_id["quick"]] == "length"
    # the engine aborted it: out of the queues, every block back (null block excluded)
    assert not sched.has_unfinished_requests()
    assert kv.get_num_free_blocks() == 200 - 1
    kv.check_invariants()


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("timeout", [0.05, 0.15, 0.25, 0.35, 0.45, 0.65, 0.75, 0.85, 1.05])
def test_timed_out_request_keeps_only_the_tokens_it_received(fast_path, async_scheduling,
                                                             timeout):
    """Steps of 0.1 s: tokens come at 0.1, 0.2, ..., so a client giving up at ``timeout``
    holds floor(timeout / 0.1) of them (none before the first: no first-token time), in
    every phase of the decode group (the request joins it after its first token; its
    counters are implicit from then on). Under async scheduling the engine's counters
    already include the batches in flight (the next two tokens); they are not the
    client's. The abort reaches the engine at the next batch boundary, which frees the
    blocks. A long prompt arriving at 0.52 s is prefilled in chunks from 0.6 s on (the
    decode group is dissolved for those steps; the slow request's counters become explicit
    with its two latest token times) without changing the slow request's one token per
    step."""
    env, kv, sched, rec, rep, box = _engine(step=0.1, fast_path=fast_path,
                                            async_scheduling=async_scheduling)
    specs = [RequestSpec(arrival_s=0.0, prompt_len=16, output_len=100, request_id="slow"),
             RequestSpec(arrival_s=0.52, prompt_len=1800, output_len=2, request_id="long")]
    client = Client(env, specs, [rep], rec, max_model_len=4096, num_gpu_blocks=200,
                    block_size=16, max_concurrency=None, control={"request_timeout_s": timeout})
    box.append(client)
    env.run()
    client.finalize()
    rec.flush()
    rows = rec.log.all_rows()
    rows = {k: v[np.argsort(rows["index"])] for k, v in rows.items()}
    assert rows["finished_reason"][0] == "timeout"
    assert rows["output_len"][0] == int(timeout * 10)
    if timeout < 0.1:
        assert math.isnan(rows["first_token_s"][0])
    else:
        assert rows["first_token_s"][0] == pytest.approx(0.1)
    assert rows["finish_s"][0] == pytest.approx(timeout)
    if timeout != 0.65:  # (0.65: long's prefill ends around its deadline, 1.17 s)
        assert rows["finished_reason"][1] == ("length" if timeout > 0.65 else "timeout")
    assert not sched.has_unfinished_requests() and kv.get_num_free_blocks() == 199


def _timeout_run(fast_path: bool, async_scheduling: bool, monkeypatch=None):
    """40 requests of mixed lengths, arriving over 0.4 s into a 16-seat engine whose step time
    grows with its tokens, and a 0.3 s client timeout: requests time out while waiting, in
    prefill, just after their first token and deep in decode (in and out of the decode
    group). With ``monkeypatch``: the engine time of every token (exact loop only)."""
    rng = np.random.default_rng(7)
    env, kv, sched, rec, rep, box = _engine(400, lambda shape: 0.004 + 2e-5 * shape.num_tokens,
                                            fast_path, async_scheduling, seqs=16, budget=256)
    specs = [RequestSpec(arrival_s=float(t), prompt_len=int(p), output_len=int(o),
                         request_id=f"r{i}")
             for i, (t, p, o) in enumerate(zip(np.sort(rng.uniform(0, 0.4, 40)),
                                              rng.integers(8, 300, 40),
                                              rng.integers(1, 120, 40)))]
    tokens: dict[str, list[float]] = {}
    if monkeypatch is not None:
        orig = Scheduler.update_from_output

        def tap(self, out, now, *a, **k):
            before = [(r, r.num_output_tokens) for r, _, _ in out.scheduled]
            res = orig(self, out, now, *a, **k)
            for r, k0 in before:
                tokens.setdefault(r.request_id, []).extend([now] * (r.num_output_tokens - k0))
            return res

        monkeypatch.setattr(Scheduler, "update_from_output", tap)
    client = Client(env, specs, [rep], rec, max_model_len=4096, num_gpu_blocks=400,
                    block_size=16, max_concurrency=None, control={"request_timeout_s": 0.3})
    box.append(client)
    env.run()
    client.finalize()
    rec.flush()
    rows = rec.log.all_rows()
    assert not sched.has_unfinished_requests() and kv.get_num_free_blocks() == 399
    order = np.argsort(rows["index"])
    return {k: v[order] for k, v in rows.items()}, specs, tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_timeouts_keep_the_tokens_delivered_by_the_deadline(async_scheduling, monkeypatch):
    """By definition (exact loop, every token's engine time tapped): a request that times
    out at send + 0.3 s keeps the tokens whose batches ended by then (the batches in flight
    are not the client's), its first-token time only if it got one; the decode-group fast
    path (implicit counters) reports exactly the same rows."""
    rows, specs, tokens = _timeout_run(False, async_scheduling, monkeypatch)
    reasons = rows["finished_reason"].tolist()
    assert 10 <= reasons.count("timeout") <= 30 and "length" in reasons
    got_some = 0
    for i, spec in enumerate(specs):
        times = tokens.get(spec.request_id, [])
        if reasons[i] == "timeout":
            deadline = spec.arrival_s + 0.3
            assert rows["finish_s"][i] == pytest.approx(deadline, abs=1e-12)
            kept = [t for t in times if t <= deadline]
            assert rows["output_len"][i] == len(kept), spec.request_id
            got_some += len(kept) > 0
            if kept:
                assert rows["first_token_s"][i] == kept[0]
            else:
                assert math.isnan(rows["first_token_s"][i])
        else:
            assert rows["output_len"][i] == spec.output_len == len(times)
            assert rows["first_token_s"][i] == times[0] and rows["finish_s"][i] == times[-1]
    assert got_some >= 5  # timed out mid-decode, not only while waiting
    monkeypatch.undo()
    fast, _, _ = _timeout_run(True, async_scheduling)
    for k in ("output_len", "first_token_s", "finish_s", "first_scheduled_s",
              "num_preemptions"):
        np.testing.assert_array_equal(fast[k], rows[k], err_msg=k)
    assert fast["finished_reason"].tolist() == reasons


def test_finish_requests_removes_waiting_and_running_requests():
    kv = KVCacheManager(100, 16, True, 4096)
    sched = Scheduler(SchedulerParams(max_num_seqs=1, max_num_batched_tokens=512,
                                      max_model_len=4096, block_size=16), kv)
    a = Request(RequestSpec(0.0, 40, 100, request_id="a"), 0, 4096, 0.0)
    b = Request(RequestSpec(0.0, 40, 100, request_id="b"), 1, 4096, 0.0)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):  # a runs (decode group), b waits (max_num_seqs = 1)
        out = sched.schedule()
        sched.update_from_output(out, 1.0, 1.0, [], [])
    assert a in sched.running and a.blocks
    done = sched.finish_requests([a, b], RequestStatus.FINISHED_ABORTED)
    assert done == [a, b]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and kv.get_num_free_blocks() == 99
    assert sched.finish_requests([a], RequestStatus.FINISHED_ABORTED) == []  # idempotent
    kv.check_invariants()


def run(*overrides):
    cfg = resolve_config(load_config(None, ["workload.input_len=300", "workload.output_len=40",
                                            *overrides]))
    return run_experiment(cfg, resolved=True)


def test_overloaded_run_with_timeouts_and_retries_accounts_for_every_request():
    base = ["workload.num_prompts=300", "workload.input_len=2048", "workload.output_len=256",
            "workload.request_rate=40", "cache.num_gpu_blocks_override=2000",
            "model.max_model_len=8192"]
    r = run(*base, "client.request_timeout_s=15")
    reason = r.requests["finished_reason"]
    n_to = int((reason == "timeout").sum())
    assert 0 < n_to < 300
    assert int(np.isin(reason, ["stop", "length"]).sum()) + n_to == 300
    assert (r.requests["attempts"] == 1).all()
    r2 = run(*base, "client.request_timeout_s=15", "client.max_retries=1")
    att = r2.requests["attempts"]
    assert att.max() == 2 and ((att == 2) | (r2.requests["finished_reason"] != "timeout")).all()
    from servesim.reports import compute_bench_result

    b = compute_bench_result(r)
    assert b["failed_reasons"] == {"timeout": n_to} and b["failed"] == n_to


def _peak(send, fin):
    ev = sorted([(t, 1) for t in send] + [(t, -1) for t in fin], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in ev:
        level += d
        peak = max(peak, level)
    return peak


def test_stages_run_in_order_drain_and_respect_their_concurrency():
    r = run("workload.num_prompts=50", "workload.stages=[{rate: 8, duration_s: 5}, "
            "{concurrency: 3, num_requests: 30, gap_s: 2}, {concurrency: 5, duration_s: 4}]",
            "workload.warmup={num_requests: 2}")
    q = r.requests
    stage, send, fin = q["stage"], q["send_s"], q["finish_s"]
    assert (np.diff(stage) >= 0).all()  # request order follows the stages
    assert (stage == 0).sum() == 40 and (stage == 1).sum() == 30
    # barrier: stage 1 starts when stage 0 has lasted its duration and drained, plus its gap
    assert send[stage == 1].min() == pytest.approx(max(fin[stage == 0].max(), 5.0) + 2.0)
    assert send[stage == 2].min() >= fin[stage == 1].max()
    assert _peak(send[stage == 1], fin[stage == 1]) <= 3
    assert _peak(send[stage == 2], fin[stage == 2]) <= 5
    # a closed-loop duration stage stops sending after its duration
    s2 = send[stage == 2]
    assert s2.max() - s2.min() <= 4.0 + 1e-9 and (stage == 2).sum() >= 5
    # warm-up: the first 2 requests of every stage
    for k in range(3):
        assert q["warmup"][stage == k][:2].all() and not q["warmup"][stage == k][2:].any()
    from servesim.reports import compute_bench_result

    b = compute_bench_result(r)
    assert b["num_warmup_requests"] == 6
    assert b["completed"] + b["failed"] == len(stage) - 6
    assert [s["num_prompts"] for s in b["stages"]] == [38, 28, int((stage == 2).sum()) - 2]
    assert b["stages"][1]["max_concurrency"] == 3
    assert all(s["mean_itl_ms"] > 0 and s["mean_ttft_ms"] > 0 for s in b["stages"])


def test_grace_period_cancels_requests_in_flight_at_the_end_of_a_stage():
    r = run("workload.num_prompts=50", "workload.output_len=2000",
            "workload.stages=[{concurrency: 4, duration_s: 3, grace_s: 1}]")
    q = r.requests
    reason = q["finished_reason"]
    assert (reason == "cancelled").sum() == 4  # the 4 in flight when time ran out
    assert np.nanmax(np.where(reason == "cancelled", q["send_s"], np.nan)) < 3.0


def test_warm_up_stage_is_left_out_of_the_metrics():
    r = run("workload.num_prompts=50", "workload.stages=[{concurrency: 2, num_requests: 6, "
            "warmup: true}, {rate: 10, num_requests: 20}]")
    from servesim.reports import compute_bench_result

    b = compute_bench_result(r)
    assert b["completed"] == 20 and b["num_warmup_requests"] == 6
    assert b["stages"][0]["warmup"] and not b["stages"][1]["warmup"]
    assert math.isclose(b["request_rate"], 10.0)


def test_plain_runs_are_unchanged_by_the_client_control():
    r = run("workload.num_prompts=40")
    assert "stage" not in r.requests and not r.client_columns
    from servesim.reports import compute_bench_result

    b = compute_bench_result(r)
    assert "stages" not in b and "failed_reasons" not in b


def test_retried_attempts_joining_the_decode_group_at_the_same_step():
    """A retry is a fresh Request with its first attempt's index; two attempts of one request
    in the decode group at once (the first aborted, the second joining at the same step with
    the same context) used to tie in the group's context heap and crash."""
    r = run("workload.num_prompts=120", "workload.input_len=1024", "workload.output_len=60",
            "workload.request_rate=12", "client.request_timeout_s=2", "client.max_retries=1",
            "scheduler.max_num_seqs=32")
    reason = r.requests["finished_reason"]
    assert len(reason) == 120 and (reason == "timeout").any() and (reason == "length").any()
