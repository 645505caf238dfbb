"""Metric oracles of the engine side: ``timeseries.csv`` batches, gauges and counters, vLLM's
engine-side columns and statistics, the frontend's tokenizer batches (see ``metric_oracle.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from metric_oracle import FRONTEND_PRIORS, close, floats, ms, vllm_stats

# ---------------------------------------------------------------------------------------------
# timeseries.csv and the counters


def test_timeseries_rows_are_the_batches(run):
    """One row per batch, written when it returns (in schedule order: FIFO): time_s = its end,
    step_seconds = end − start with start = max(scheduled, previous batch's end), its scheduled
    and generated tokens; every token at a batch end, every first scheduling at a schedule()."""
    ts, tap, o = run.ts, run.tap, run.oracle
    assert tap.returns == list(range(len(tap.batches)))
    end = floats(ts["time_s"])
    dur = floats(ts["step_seconds"])
    close(end, [b.end for b in tap.batches], "batch end times")
    close(end - dur, o.batch_start, "batch start times")
    if run.cfg.parallel.pipeline_parallel_size == 1:  # one batch on the GPU at a time
        assert (np.diff(end) > 0).all() and (end[1:] - dur[1:] >= end[:-1] - 1e-12).all()
    else:  # pipeline stages: a batch starts before the previous one returns, and returns in
        # order (a short batch behind a long one returns with it)
        assert (np.diff(end) >= 0).all() and (np.diff(end) == 0).any()
        assert (end[1:] - dur[1:] < end[:-1] - 1e-12).sum() >= len(end) // 2
    tok = floats(ts["step_tokens"])
    assert tok.tolist() == [float(b.num_tokens) for b in tap.batches]
    assert floats(ts["num_generated_tokens"]).tolist() == [
        float(sum(b.tokens.values())) for b in tap.batches]
    close(floats(ts["num_prefill_tokens"]) + floats(ts["num_decode_reqs"]), tok,
          "prefill + decode tokens = batch tokens")
    assert run.json["num_steps"] == len(tap.batches)
    ends = set(end.tolist())
    assert all(t in ends for i in o.ids for t in tap.tokens[i])
    assert set(o.first_sched.tolist()) <= {b.scheduled_at for b in tap.batches}
    if run.cfg.parallel.pipeline_parallel_size > 1:
        pass  # scheduled while a stage is free (start checked above)
    elif not run.cfg.scheduler.async_scheduling:  # synchronous: scheduled when the GPU is free
        close([b.scheduled_at for b in tap.batches], o.batch_start, "sync schedule = start")
    else:  # async: batch k+1 is scheduled while batch k runs (two in flight)
        assert sum(b.scheduled_at < s for b, s in zip(tap.batches, o.batch_start)) > \
            len(tap.batches) // 2


def _state_at_returns(run):
    """Per timeseries row (the r-th batch return): the batches scheduled by then (vLLM
    schedules the next batch after recording the returned one) and the requests finished by
    then (stops are applied when the batch with the last token returns, before the record)."""
    tap, o = run.tap, run.oracle
    if run.cfg.parallel.pipeline_parallel_size > 1:
        pytest.skip("pipeline parallelism: the tap sees a batch when it returns, not when it "
                    "is scheduled (the scheduled-by-then sets are not observable here)")
    last = {rid: ks[-1] for rid, ks in tap.token_batches.items()}
    for r, k in enumerate(tap.returns):
        scheduled = [j for j, b in enumerate(tap.batches) if b.returned_before <= r]
        finished = {rid for rid, j in last.items()
                    if j in tap.returns[:r + 1] and o.done[o.ids.index(rid)]}
        yield r, tap.batches[k], scheduled, finished


def test_timeseries_gauges(run):
    """At each batch return: running = admitted by the batches scheduled so far, not finished;
    waiting = in the engine's queue (queued before the return), not admitted; the preemption
    counter ends at the per-request total; vLLM's scheduled-token conservation (prompt − hits
    + out − 1 per request, more after a preemption's recompute)."""
    o, ts, tap = run.oracle, run.ts, run.tap
    running = floats(ts["vllm:num_requests_running"])
    waiting = floats(ts["vllm:num_requests_waiting"])
    pre_total = floats(ts["vllm:num_preemptions_total"])
    assert pre_total[-1] == o.preemptions.sum() and (np.diff(pre_total) >= 0).all()
    need = int((o.prompt - o.cached + o.out - 1).sum())
    total = int(floats(ts["step_tokens"]).sum())
    if o.preemptions.sum():
        assert total > need
        assert (running + waiting <= len(o.ids)).all()
        return
    assert total == need
    first = np.array([tap.first_batch[i] for i in o.ids])
    for r, b, scheduled, finished in _state_at_returns(run):
        admitted = first <= max(scheduled)
        done = np.array([i in finished for i in o.ids])
        assert running[r] == (admitted & ~done).sum(), r
        assert waiting[r] == ((o.queued < b.end) & ~admitted).sum(), r


def test_kv_cache_usage_from_block_counts(run):
    """Without shared prefixes or preemptions: used blocks at a batch return = Σ over the
    admitted, unfinished requests of ceil(computed tokens after the latest batch scheduled
    for them / block_size) (blocks are allocated at schedule time, freed when the stop is
    applied); usage = used / (num_gpu_blocks − 1) (the null block is not counted)."""
    if run.cfg.workload.prefix_len or run.oracle.preemptions.sum():
        pytest.skip("needs unshared blocks and no preemption")
    bs = run.cfg.cache.block_size
    nb = run.json["num_gpu_blocks"]
    usage = floats(run.ts["vllm:kv_cache_usage_perc"])
    tap = run.tap
    for r, _, scheduled, finished in _state_at_returns(run):
        held: dict[str, int] = {}
        for j in scheduled:
            held.update(tap.batches[j].after)
        used = sum(-(-c // bs) for rid, c in held.items() if rid not in finished)
        assert usage[r] == pytest.approx(used / (nb - 1), rel=1e-12, abs=1e-15), r


def test_prefix_cache_counters(run):
    """vLLM PrefixCacheStats without head-of-line retries: queries = Σ prompt tokens at the
    first scheduling, hits = Σ num_cached_tokens; the hit rate is their ratio."""
    o, j = run.oracle, run.json
    q = floats(run.ts["vllm:prefix_cache_queries_total"])
    h = floats(run.ts["vllm:prefix_cache_hits_total"])
    assert (q[-1], h[-1]) == (j["prefix_cache_queries"], j["prefix_cache_hits"])
    if run.name != "prefix":
        return
    assert j["prefix_cache_queries"] == int(o.prompt.sum())
    assert j["prefix_cache_hits"] == int(o.cached.sum())
    assert j["prefix_cache_hit_rate"] == pytest.approx(o.cached.sum() / o.prompt.sum())
# ---------------------------------------------------------------------------------------------
# the engine's side (vLLM's Prometheus histograms) and the frontend


def test_engine_side_columns_by_definition(run):
    """requests.csv's engine-side columns: vLLM's ``arrival_time`` (end of the API server's
    request work), tokenized and queued times, engine TTFT/E2EL from arrival_time to the
    output work's start, prefill / decode / engine TPOT from the engine's token times (all
    equal to the client's without a frontend)."""
    o, c = run.oracle, run.csv
    close(floats(c["frontend_arrival_s"]), o.fe_arrival, "frontend_arrival_s")
    close(floats(c["tokenized_s"]), o.tokenized, "tokenized_s")
    close(floats(c["queued_s"]), o.queued, "queued_s")
    close(floats(c["engine_first_token_s"]), o.engine_first, "engine_first_token_s")
    close(floats(c["first_token_iter_s"]), o.first_iter, "first_token_iter_s")
    close(floats(c["engine_ttft_s"]), o.engine_ttft, "engine_ttft_s")
    close(floats(c["engine_e2el_s"]), o.engine_e2el, "engine_e2el_s")
    close(floats(c["engine_tpot_s"]), o.engine_tpot, "engine_tpot_s")
    close(floats(c["prefill_s"]), o.prefill, "prefill_s")
    close(floats(c["decode_s"]), o.decode, "decode_s")
    if run.frontend:  # the frontend's terms are there, and ordered
        assert (o.fe_arrival - o.send >= run.oracle.fe["request_s"] - 1e-15).all()
        assert (o.queued > o.tokenized).all() and (o.tokenized > o.fe_arrival).all()
        assert (o.first_token > o.engine_first).all() and (o.engine_ttft < o.ttft).all()
    else:
        close(o.ttft, o.engine_ttft, "engine TTFT = client TTFT without a frontend")


def test_engine_statistics_and_ttft_breakdown(run):
    """result.json's ``<stat>_engine_<metric>_ms`` over completed requests (vLLM's np
    statistics), the engine's ITL sample (gaps between engine token times), and
    ``ttft_breakdown_ms``: six means whose sum is the mean client TTFT."""
    o, j = run.oracle, run.json
    d = o.done
    series = {"ttft": o.engine_ttft[d], "tpot": o.engine_tpot[d],
              "e2el": o.engine_e2el[d], "queue_time": o.queue[d],
              "prefill_time": o.prefill[d], "decode_time": o.decode[d],
              "itl": np.concatenate([o.engine_itls[i] for i in np.flatnonzero(d)])}
    for metric, x in series.items():
        for stat, v in vllm_stats(x).items():
            assert j[f"{stat}_engine_{metric}_ms"] == pytest.approx(v, rel=1e-9, abs=1e-9), \
                f"{stat}_engine_{metric}_ms"
    terms = {"api_server": o.fe_arrival - o.send, "tokenizer": o.tokenized - o.fe_arrival,
             "ipc_in": o.queued - o.tokenized, "engine_queue": o.first_sched - o.queued,
             "engine_prefill": o.engine_first - o.first_sched,
             "output": o.first_token - o.engine_first}
    got = j["ttft_breakdown_ms"]
    assert list(got) == list(terms)
    for k, v in terms.items():  # (summed in whole nanoseconds)
        assert got[k] == pytest.approx(ms(v[d].mean()), rel=1e-6, abs=1e-6), k
    assert sum(got.values()) == pytest.approx(ms(o.ttft[d].mean()), rel=1e-6)
    # ipc_in: the hop, then the engine core's input queue until the engine loop takes the
    # request in (the step running when it came ends): at least the hop, more when it came
    # mid-step (the open-loop scenarios' requests mostly do)
    wait_in = o.queued - o.tokenized - (o.fe["ipc_s"] if run.frontend else 0.0)
    assert (wait_in >= -1e-12).all()
    if "open_loop" in run.name:
        assert (wait_in[d] > 0).mean() > 0.5
    if run.frontend:
        p = o.fe
        assert got["ipc_in"] >= ms(p["ipc_s"]) - 1e-9
        assert got["api_server"] >= ms(p["request_s"]) - 1e-9
        assert j["frontend"]["params"] == FRONTEND_PRIORS
    else:
        assert all(got[k] == 0 for k in ("api_server", "tokenizer", "output"))


def test_frontend_tokenizer_batches(run):
    """The fe_* scenarios exercise vLLM's micro-batching (several prompts per batch) below the
    32-prompt cap (which closes a batch early; unit-tested in tests/simulator)."""
    if not run.frontend:
        pytest.skip("engine only")
    sizes = run.oracle.batch_sizes
    assert max(sizes) < FRONTEND_PRIORS["tokenizer_max_batch"]
    assert sum(sizes) == len(run.oracle.ids)
    if run.name == "fe_closed_loop":
        assert max(sizes) >= 2  # four requests sent at t = 0 share a window
    assert run.result.counters["tokenizer_batches"] == len(sizes)
