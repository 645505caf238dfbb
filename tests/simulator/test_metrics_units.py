"""``simulator/metrics.py`` piece by piece, by value: the per-request derivation on hand-made
rows (every branch: completed, one-token, rejected, in flight), the request log (memory,
spill, windows, empty), the lazy column mapping, ``Distribution`` (exact, sketched, empty) and
``RunResult`` helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from servesim.simulator import metrics
from servesim.simulator.metrics import (
    RAW_FIELDS,
    RAW_STRINGS,
    Distribution,
    LazyRequests,
    RequestLog,
    RunResult,
    derive_request_columns,
)

NAN = math.nan


def raw_rows(n_offset=0, reasons=("length", "stop", "rejected", "in_flight", "length"),
             frontend=True):
    """Five raw engine rows (s, tokens). Row 1 has one output token; row 2 was rejected when
    it reached the engine; row 3 never finished; row 4 was queued by the client
    (send > arrival).

    ``frontend``: the API server's timestamps (multiples of 1/32 s, exact in binary): vLLM's
    arrival_time = send + 1/32 (request work), tokenized + 1/16, queued in the engine core
    + 3/32; the engine's first/last token 1/8 s before the client sees it, the output work
    starting 3/32 s before. Without: the rows an engine-only run records (arrival = queued
    = send, engine times NaN: the client's are the engine's)."""
    k = len(reasons)
    send = np.array([0.0, 0.5, 1.0, 1.5, 2.75])[:k]
    first = np.array([0.5, 0.75, NAN, 2.0, 3.25])[:k]
    finish = np.array([1.5, 0.75, 1.09375, NAN, 4.25])[:k]
    r = {
        "index": np.arange(k, dtype=float) + n_offset,
        "arrival_s": np.array([0.0, 0.5, 1.0, 1.5, 2.0])[:k],
        "send_s": send,
        "prompt_len": np.array([100.0, 20, 9000, 50, 64])[:k],
        "output_len": np.array([5.0, 1, 0, 2, 3])[:k],
        "num_cached_tokens": np.array([0.0, 16, 0, 0, 32])[:k],
        "first_scheduled_s": np.array([0.25, 0.625, NAN, 1.75, 3.0])[:k],
        "first_token_s": first,
        "finish_s": finish,
        "num_preemptions": np.array([1.0, 0, 0, 0, 2])[:k],
        "stage": np.array([0.0, 0, 1, 1, 1])[:k],
        "warmup": np.array([1.0, 0, 0, 0, 0])[:k],
        "attempts": np.array([1.0, 1, 1, 2, 1])[:k],
        "request_id": np.array([f"r{i + n_offset}" for i in range(k)], dtype=object),
        "finished_reason": np.array(reasons, dtype=object),
        "error": np.array(["", "", "too long", "still in flight", ""][:k], dtype=object),
    }
    if frontend:
        done = np.array([True, True, False, False, True])[:k]
        r |= {"frontend_arrival_s": send + 1 / 32, "tokenized_s": send + 1 / 16,
              "queued_s": send + 3 / 32,
              "engine_first_token_s": first - 1 / 8, "first_token_iter_s": first - 3 / 32,
              "engine_finish_s": np.where(done, finish - 1 / 8, NAN),
              "finish_iter_s": np.where(done, finish - 3 / 32, NAN)}
    else:
        r |= {"frontend_arrival_s": send, "tokenized_s": send, "queued_s": send}
        r |= {f: np.full(k, NAN) for f in ("engine_first_token_s", "first_token_iter_s",
                                            "engine_finish_s", "finish_iter_s")}
    assert set(r) == set(RAW_FIELDS) | set(RAW_STRINGS)
    return r


def test_derive_request_columns_by_hand():
    c = derive_request_columns(raw_rows())
    nan = np.nan
    np.testing.assert_array_equal(c["ttft_s"], [0.5, 0.25, nan, nan, 0.5])
    np.testing.assert_array_equal(c["e2el_s"], [1.5, 0.25, nan, nan, 1.5])
    # TPOT = (E2EL − TTFT)/(out − 1): (1.5 − 0.5)/4, undefined for one token, (1.5 − .5)/2
    np.testing.assert_array_equal(c["tpot_s"], [0.25, nan, nan, nan, 0.5])
    # a failed request's finish is when it ended for the client (the rejection at 1.09375);
    # NaN for the one still in flight
    np.testing.assert_array_equal(c["finish_s"], [1.5, 0.75, 1.09375, nan, 4.25])
    # queue = first scheduled − queued in the engine core (send + 3/32; not arrival, for the
    # client-queued row 4)
    np.testing.assert_array_equal(c["queue_s"], [0.15625, 0.03125, nan, 0.15625, 0.15625])
    for k in ("prompt_len", "output_len", "num_cached_tokens", "num_preemptions"):
        assert c[k].dtype == np.int64, k
    assert c["prompt_len"].tolist() == [100, 20, 9000, 50, 64]
    assert c["output_len"].tolist() == [5, 1, 0, 2, 3]
    assert c["num_cached_tokens"].tolist() == [0, 16, 0, 0, 32]
    assert c["num_preemptions"].tolist() == [1, 0, 0, 0, 2]
    np.testing.assert_array_equal(c["arrival_s"], [0.0, 0.5, 1.0, 1.5, 2.0])
    np.testing.assert_array_equal(c["send_s"], [0.0, 0.5, 1.0, 1.5, 2.75])
    np.testing.assert_array_equal(c["first_token_s"], [0.5, 0.75, nan, 2.0, 3.25])
    np.testing.assert_array_equal(c["first_scheduled_s"], [0.25, 0.625, nan, 1.75, 3.0])
    assert c["request_id"].tolist() == ["r0", "r1", "r2", "r3", "r4"]
    assert c["finished_reason"].tolist() == ["length", "stop", "rejected", "in_flight",
                                             "length"]
    assert c["error"].tolist() == ["", "", "too long", "still in flight", ""]
    # engine side (vLLM's Prometheus histograms), from vLLM's arrival_time (send + 1/32) to
    # the output handler's iteration start (the engine's token + 1/32)
    np.testing.assert_array_equal(c["engine_ttft_s"], [0.375, 0.125, nan, nan, 0.375])
    np.testing.assert_array_equal(c["engine_e2el_s"], [1.375, 0.125, nan, nan, 1.375])
    # prefill = engine first token − first scheduled; decode = engine last − first token;
    # engine TPOT = decode / (out − 1), 0 for a one-token request (vLLM observes 0)
    np.testing.assert_array_equal(c["prefill_s"], [0.125, 0.0, nan, nan, 0.125])
    np.testing.assert_array_equal(c["decode_s"], [1.0, 0.0, nan, nan, 1.0])
    np.testing.assert_array_equal(c["engine_tpot_s"], [0.25, 0.0, nan, nan, 0.5])
    np.testing.assert_array_equal(c["frontend_arrival_s"], np.array(c["send_s"]) + 1 / 32)
    np.testing.assert_array_equal(c["tokenized_s"], np.array(c["send_s"]) + 1 / 16)
    np.testing.assert_array_equal(c["queued_s"], np.array(c["send_s"]) + 3 / 32)
    np.testing.assert_array_equal(c["engine_first_token_s"],
                                  [0.375, 0.625, nan, 1.875, 3.125])
    np.testing.assert_array_equal(c["first_token_iter_s"],
                                  [0.40625, 0.65625, nan, 1.90625, 3.15625])
    assert set(c) == (set(metrics.REQUEST_COLUMNS) | set(metrics.ENGINE_COLUMNS)
                      | {"send_s", "error", "frontend_arrival_s", "tokenized_s", "queued_s",
                         "engine_first_token_s", "first_token_iter_s"})
    assert not set(metrics.CLIENT_COLUMNS) & set(c)


def test_derive_engine_only_rows_equal_the_client_times():
    """Without a frontend the engine's times are the client's: engine TTFT/E2EL/TPOT equal
    the client's (but a one-token request's engine TPOT is 0, where vllm bench serve has
    none), queue = first scheduled − send, prefill = first token − first scheduled, decode =
    finish − first token."""
    c = derive_request_columns(raw_rows(frontend=False))
    nan = np.nan
    np.testing.assert_array_equal(c["queue_s"], [0.25, 0.125, nan, 0.25, 0.25])
    for k in ("ttft", "e2el"):
        np.testing.assert_array_equal(c[f"engine_{k}_s"], c[f"{k}_s"], err_msg=k)
    np.testing.assert_array_equal(c["tpot_s"], [0.25, nan, nan, nan, 0.5])
    np.testing.assert_array_equal(c["engine_tpot_s"], [0.25, 0.0, nan, nan, 0.5])
    np.testing.assert_array_equal(c["engine_ttft_s"], [0.5, 0.25, nan, nan, 0.5])
    np.testing.assert_array_equal(c["prefill_s"], [0.25, 0.125, nan, nan, 0.25])
    np.testing.assert_array_equal(c["decode_s"], [1.0, 0.0, nan, nan, 1.0])
    np.testing.assert_array_equal(c["engine_first_token_s"], [0.5, 0.75, nan, 2.0, 3.25])
    np.testing.assert_array_equal(c["first_token_iter_s"], [0.5, 0.75, nan, 2.0, 3.25])
    # rows written before the frontend existed (no frontend fields at all): the same
    legacy = {k: v for k, v in raw_rows(frontend=False).items()
              if k not in ("frontend_arrival_s", "tokenized_s", "queued_s",
                           "engine_first_token_s", "first_token_iter_s", "engine_finish_s",
                           "finish_iter_s")}
    old = derive_request_columns(legacy)
    assert set(old) == set(c)
    for k in c:
        if c[k].dtype.kind == "f":
            np.testing.assert_array_equal(old[k], c[k], err_msg=k)
        else:
            assert old[k].tolist() == c[k].tolist(), k


def test_derive_client_columns():
    """Runs with stages, warm-up or timeouts add stage (int), warmup (bool), attempts (int)."""
    c = derive_request_columns(raw_rows(), client_columns=True)
    assert c["stage"].tolist() == [0, 0, 1, 1, 1] and c["stage"].dtype == np.int64
    assert c["warmup"].tolist() == [True, False, False, False, False]
    assert c["warmup"].dtype == bool
    assert c["attempts"].tolist() == [1, 1, 1, 2, 1] and c["attempts"].dtype == np.int64
    plain = derive_request_columns(raw_rows())
    assert set(c) - set(plain) == set(metrics.CLIENT_COLUMNS)


def test_derive_is_row_wise():
    whole = derive_request_columns(raw_rows())
    parts = [derive_request_columns({k: v[a:b] for k, v in raw_rows().items()})
             for a, b in ((0, 2), (2, 5))]
    for k in whole:
        got = np.concatenate([p[k] for p in parts])
        if got.dtype.kind == "f":
            np.testing.assert_array_equal(got, whole[k])
        else:
            assert got.tolist() == whole[k].tolist()


def _chunk(idx, reasons=None):
    """Raw rows of an engine-only run (no frontend, no client control)."""
    n = len(idx)
    reasons = reasons or ["length"] * n
    send = np.asarray(idx, dtype=float) * 0.5
    return {
        "stage": np.zeros(n), "warmup": np.zeros(n), "attempts": np.ones(n),
        "frontend_arrival_s": send, "tokenized_s": send, "queued_s": send,
        "engine_first_token_s": np.full(n, NAN), "engine_finish_s": np.full(n, NAN),
        "first_token_iter_s": np.full(n, NAN), "finish_iter_s": np.full(n, NAN),
        "index": np.asarray(idx, dtype=float),
        "arrival_s": np.asarray(idx, dtype=float) * 0.5,
        "send_s": np.asarray(idx, dtype=float) * 0.5,
        "prompt_len": np.full(n, 10.0), "output_len": np.full(n, 2.0),
        "num_cached_tokens": np.zeros(n), "first_scheduled_s": np.asarray(idx) * 0.5 + 0.1,
        "first_token_s": np.asarray(idx) * 0.5 + 0.2, "finish_s": np.asarray(idx) * 0.5 + 1.0,
        "num_preemptions": np.zeros(n),
        "request_id": np.array([str(i) for i in idx], dtype=object),
        "finished_reason": np.array(reasons, dtype=object),
        "error": np.array([""] * n, dtype=object),
    }


@pytest.mark.parametrize("spill", [None, 3])
def test_request_log_windows_and_max_finish(tmp_path, spill):
    log = RequestLog(tmp_path / "spool", spill_rows=spill)
    log.append(_chunk([4, 1, 6]))
    log.append(_chunk([]))  # nothing
    log.append(_chunk([0, 5, 2, 3], reasons=["length", "stop", "rejected", "length"]))
    assert log.num_rows == 7 and log.spilled == (spill is not None)
    # latest end of any request: index 6 (3.0 + 1.0)
    assert log.max_finish == 4.0
    wins = list(log.windows(rows=3))
    assert [w["index"].tolist() for w in wins] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [w["request_id"].tolist() for w in wins] == [["0", "1", "2"], ["3", "4", "5"],
                                                        ["6"]]
    assert wins[0]["finished_reason"].tolist() == ["length", "length", "rejected"]
    rows = log.all_rows()
    assert rows["index"].tolist() == list(range(7))
    np.testing.assert_array_equal(rows["finish_s"], np.arange(7) * 0.5 + 1.0)
    if spill is not None:
        files = list((tmp_path / "spool").iterdir())
        assert len(files) == 1 and files[0].name.startswith(".servesim-requests-")
    log.close()
    assert log.num_rows == 0 and not log.spilled
    assert not any((tmp_path / "spool").iterdir()) if spill is not None else True


def test_request_log_spills_only_past_spill_rows(tmp_path):
    """Up to spill_rows rows stay in memory; the next chunk moves everything to disk (a
    spool folder is created, parents included) and nothing is kept in memory."""
    spool = tmp_path / "a" / "b"
    log = RequestLog(spool, spill_rows=3)
    log.append(_chunk([0, 1, 2]))
    assert not log.spilled and not spool.exists()
    log.append(_chunk([3]))
    assert log.spilled and log._mem == [] and spool.is_dir()
    assert log.all_rows()["index"].tolist() == [0, 1, 2, 3]
    log.close()


@pytest.mark.parametrize("spill", [None, 0])
def test_request_log_window_without_rows_of_an_overlapping_chunk(tmp_path, spill):
    """Chunk A holds indices 0 and 9, chunk B 1..8: the window [3, 6) overlaps A's range but
    holds none of its rows."""
    log = RequestLog(tmp_path, spill_rows=spill)
    log.append(_chunk([9, 0]))
    log.append(_chunk([1, 2, 3, 4, 5, 6, 7, 8]))
    wins = list(log.windows(rows=3))
    assert [w["index"].tolist() for w in wins] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    for w in wins:
        assert {len(v) for v in w.values()} == {len(w["index"])}
        assert w["request_id"].tolist() == [str(int(i)) for i in w["index"]]
    log.close()


def test_request_log_all_rows_beyond_one_default_window(monkeypatch):
    monkeypatch.setattr(metrics, "CHUNK_ROWS", 4)
    log = RequestLog()
    log.append(_chunk(list(range(9, -1, -1))))
    assert log.all_rows()["index"].tolist() == list(range(10))
    assert [len(w["index"]) for w in log.windows()] == [4, 4, 2]


def test_request_log_empty():
    log = RequestLog()
    rows = log.all_rows()
    assert set(rows) == set(RAW_FIELDS) | set(RAW_STRINGS)
    for k in RAW_FIELDS:
        assert rows[k].shape == (0,), k
    for k in RAW_STRINGS:
        assert rows[k].shape == (0,) and rows[k].dtype == object, k
    assert list(log.windows()) == [] and log.max_finish == -math.inf


def test_lazy_requests_mapping(tmp_path):
    log = RequestLog(tmp_path, spill_rows=1)
    log.append(_chunk([1, 0]))
    lazy = LazyRequests(log)
    assert list(lazy) == list(derive_request_columns(_chunk([0])))
    assert len(lazy) == len(list(lazy))
    assert lazy["request_id"].tolist() == ["0", "1"]
    np.testing.assert_allclose(lazy["ttft_s"], [0.2, 0.2], rtol=1e-12)
    with pytest.raises(KeyError):
        lazy["nope"]
    log.close()
    empty = LazyRequests(RequestLog())
    assert empty["ttft_s"].shape == (0,)


# ---------------------------------------------------------------------------------------------
# Distribution


def test_distribution_exact_order_and_counts():
    d = Distribution(exact_limit=100)
    assert d.exact and d.values().shape == (0,) and d.exact_sample()[1].dtype == np.int64
    d.add(np.array([3.0, 1.0]))
    d.add(np.array([7.0]), np.array([4]), group=1)
    d.add(np.array([2.0]))
    d.add(np.array([]))
    v, c = d.exact_sample()
    assert v.tolist() == [3.0, 1.0, 2.0, 7.0]  # group 0 in insertion order, then group 1
    assert c.tolist() == [1, 1, 1, 4] and c.dtype == np.int64
    e = Distribution().exact_sample()
    assert e[0].shape == (0,) and e[1].shape == (0,)


def test_distribution_exact_up_to_the_limit():
    d = Distribution(exact_limit=3)
    d.add(np.array([1, 2]))
    d.add(np.array([3]))
    assert d.exact and d.values().tolist() == [1.0, 2.0, 3.0]
    d.add(np.array([4]))
    assert not d.exact


def test_distribution_sketch_moments_and_quantiles():
    """Past the exact limit: exact count, mean and population std (weighted), DDSketch
    quantiles within the relative accuracy; NaN ignored."""
    rng = np.random.default_rng(0)
    x = rng.lognormal(0, 1, 5000)
    w = rng.integers(1, 4, 5000)
    d = Distribution(exact_limit=1000, relative_accuracy=0.01)
    for lo in range(0, 5000, 700):
        d.add(x[lo:lo + 700], w[lo:lo + 700])
    d.add(np.array([np.nan, 1.0]), np.array([5, 0]))  # ignored: NaN, zero count
    assert not d.exact
    full = np.repeat(x, w)
    assert d.count == len(full)
    assert d.mean == pytest.approx(full.mean(), rel=1e-12)
    assert d.std() == pytest.approx(full.std(), rel=1e-9)
    for q in (0.1, 0.5, 0.99):
        exact = np.sort(full)[int(q * (len(full) - 1))]
        assert d.quantile(q) == pytest.approx(exact, rel=0.011)


def test_distribution_sketch_counts_zero_and_empty():
    d = Distribution(exact_limit=2)
    d.add(np.array([0.0, 0.0, 0.0, 5.0]))
    assert not d.exact and d.count == 4 and d.mean == 1.25
    assert d.quantile(0.5) == 0.0 and d.quantile(1.0) == pytest.approx(5.0, rel=0.002)
    d.add(np.array([5.0]))  # streamed after the switch
    assert d.count == 5 and d.mean == 2.0
    e = Distribution(exact_limit=0)
    e.add(np.array([np.nan]))
    assert not e.exact and e.count == 0
    assert e.std() == 0.0 and e.quantile(0.5) == 0.0 and e.mean == 0.0


def test_distribution_switch_keeps_every_sample():
    d = Distribution(exact_limit=3)
    d.add(np.array([1.0, 2.0]))
    d.add(np.array([3.0, 4.0]))  # 4 > 3: sketched
    assert not d.exact and d.count == 4 and d.mean == 2.5
    assert d._stored == 0 and d._parts == {}
    d.add(np.array([10.0]))
    assert d.count == 5 and d.mean == 4.0


# ---------------------------------------------------------------------------------------------
# RunResult helpers


def _result(n):
    cols = derive_request_columns({k: v[:n] for k, v in raw_rows().items()}) if n else \
        derive_request_columns({k: v[:0] for k, v in raw_rows().items()})
    return RunResult(config=None, requests=cols, itl_values=np.zeros(0),
                     itl_counts=np.zeros(0, np.int64), steps={})


def test_run_result_windows_duration_and_counts():
    r = _result(5)
    assert r.num_requests == 5 and not r.streamed
    assert r.duration_s == 4.25  # latest finish of a completed request
    wins = list(r.iter_requests(rows=2))
    assert [len(w["finished_reason"]) for w in wins] == [2, 2, 1]
    assert [len(w["finished_reason"]) for w in r.iter_requests()] == [5]
    one = _result(1)
    assert [len(w["request_id"]) for w in one.iter_requests()] == [1]
    zero = _result(0)
    assert zero.num_requests == 0 and zero.duration_s == 0.0
    assert [len(w["request_id"]) for w in zero.iter_requests()] == [0]
    r.close()  # no spool: nothing to do


def test_run_result_streamed(tmp_path):
    log = RequestLog(tmp_path, spill_rows=2)
    log.append(_chunk([2, 0, 1, 3], reasons=["length", "stop", "rejected", "length"]))
    r = RunResult(config=None, requests=LazyRequests(log), itl_values=np.zeros(0),
                  itl_counts=np.zeros(0, np.int64), steps={}, request_log=log)
    assert r.streamed and r.num_requests == 4
    assert r.duration_s == 2.5  # index 3: 1.5 + 1.0
    wins = list(r.iter_requests(rows=3))
    assert [w["request_id"].tolist() for w in wins] == [["0", "1", "2"], ["3"]]
    assert next(iter(r.iter_requests()))["request_id"].tolist() == ["0", "1", "2", "3"]
    r.close()
    assert not any(tmp_path.iterdir())
    empty = RequestLog(tmp_path, spill_rows=0)
    empty.append(_chunk([0], reasons=["rejected"]))
    # only a rejected request (at 0 * 0.5 + 1.0): the run lasts until it ended (vLLM's
    # duration runs until asyncio.gather returns, failures included)
    assert RunResult(None, LazyRequests(empty), np.zeros(0), np.zeros(0), {},
                     request_log=empty).duration_s == 1.0
    empty.close()
