"""The requests a ``vllm bench serve`` result is computed over: the per-request arrays of one
window of ``RunResult.requests``, the per-request JSON lists (``latencies``, ``queue_times``, the
``save_detailed`` arrays; :class:`PerRequest` for a streamed run), and views of a run restricted
to its measured (non-warm-up) requests or to one load stage's."""

from __future__ import annotations

import math

import numpy as np
from servesim.simulator.metrics import Distribution, RunResult

COMPLETED_REASONS = ("stop", "length")


def _floats(a: np.ndarray, fill: float | None = 0.0) -> list:
    """Array → list of Python floats, NaN/inf replaced by ``fill``."""
    a = np.asarray(a, dtype=float)
    return [v if math.isfinite(v) else fill for v in a.tolist()]


def _col(requests: dict, name: str, n: int, default: float = np.nan) -> np.ndarray:
    if name in requests:
        return np.asarray(requests[name])
    return np.full(n, default)


def _errors(req: dict, reasons: np.ndarray, done: np.ndarray) -> list[str]:
    """vLLM's ``errors``: "" for a success, else the request's error (or finished_reason)."""
    err = np.asarray(req["error"]).astype(str) if "error" in req else reasons
    return [
        "" if ok else (e if e not in ("", "nan", "None") else r)
        for ok, e, r in zip(done.tolist(), err.tolist(), reasons.tolist())
    ]


class PerRequest:
    """A per-request JSON list of a streamed run (``latencies``, ``queue_times``, the
    ``save_detailed`` arrays), produced window by window when ``result.json`` is written;
    ``list(x)`` materialises it."""

    def __init__(self, result: RunResult, fn):
        self.result, self.fn = result, fn

    def windows(self):
        for req in self.result.iter_requests():
            yield self.fn(_Window(req))

    def __iter__(self):
        for part in self.windows():
            yield from part

    def __len__(self) -> int:
        return self.result.num_requests


class _Window:
    """Per-request arrays of one window of ``RunResult.requests`` (see compute_bench_result)."""

    def __init__(self, req: dict):
        self.req = req
        self.reasons = np.asarray(req["finished_reason"]).astype(str)
        n = self.n = len(self.reasons)
        self.done = np.isin(self.reasons, COMPLETED_REASONS)
        self.prompt_len = _col(req, "prompt_len", n, 0).astype(np.int64)
        self.output_len = _col(req, "output_len", n, 0).astype(np.int64)
        arrival = _col(req, "arrival_s", n).astype(float)
        self.send = _col(req, "send_s", n).astype(float) if "send_s" in req else arrival.copy()
        self.finish = _col(req, "finish_s", n).astype(float)
        # ttft_s / e2el_s are measured from send_s (RunResult contract); fill gaps from
        # timestamps
        ttft_all = _col(req, "ttft_s", n).astype(float)
        e2el_all = _col(req, "e2el_s", n).astype(float)
        with np.errstate(invalid="ignore"):
            self.ttft_all = np.where(np.isnan(ttft_all), _col(req, "first_token_s", n)
                                     - self.send, ttft_all)
            self.e2el_all = np.where(np.isnan(e2el_all), self.finish - self.send, e2el_all)
        self.client_queue = np.where(np.isfinite(self.send - arrival), self.send - arrival, 0.0)


# per-request JSON lists: key → window → list (vLLM's save_detailed arrays, then the two
# arrays vLLM always writes)
_DETAILED = {
    "input_lens": lambda w: w.prompt_len.tolist(),
    "output_lens": lambda w: np.where(w.done, w.output_len, 0).tolist(),
    # vLLM keeps a failed request's TTFT when its first chunk came (0.0 otherwise)
    "ttfts": lambda w: _floats(np.where(np.isfinite(w.ttft_all), w.ttft_all, 0.0)),
    "start_times": lambda w: _floats(w.send, None),
    "generated_texts": lambda w: [""] * w.n,
    "errors": lambda w: _errors(w.req, w.reasons, w.done),
}
_ALWAYS = {
    "latencies": lambda w: _floats(np.where(w.done, w.e2el_all, 0.0)),
    "queue_times": lambda w: _floats(w.client_queue),
}


# ---------------------------------------------------------------------------------------------
# Views for stages and warm-up (runs with a client control, ``simulator/client_control.py``)


class _View:
    """A :class:`RunResult` restricted to some requests: the measured (non-warm-up) ones, or
    one stage's. Metrics over it follow vLLM's definitions, except that ``duration`` runs from
    the first send of its requests (not from the benchmark start) until the last of them
    ended (completed or failed: cancelled, timed out)."""

    def __init__(self, parent: RunResult, keep, itl: Distribution | None, meta: dict):
        self.parent = parent
        self.keep = keep
        self.config = parent.config
        self.capacity = parent.capacity
        self.workload_meta = {**(parent.workload_meta or {}), **meta}
        self.streamed = parent.streamed
        self.request_log = None
        if itl is None:
            self.itl_values, self.itl_counts = parent.itl_values, parent.itl_counts
            self.itl_stream = parent.itl_stream
        elif itl.exact:
            self.itl_values, self.itl_counts = itl.exact_sample()
            self.itl_stream = None
        else:
            self.itl_values, self.itl_counts, self.itl_stream = np.zeros(0), np.zeros(0), itl
        n = t0 = 0
        t0, t1, warm = math.inf, -math.inf, 0
        itls = getattr(parent, "request_itls", None)
        masks = []
        for w in parent.iter_requests():
            m = keep(w)
            masks.append(m)
            if "warmup" in w:
                warm += int(np.asarray(w["warmup"], dtype=bool).sum())
            n += int(m.sum())
            send = np.asarray(w["send_s"], dtype=float)[m]
            send = send[np.isfinite(send)]
            if len(send):
                t0 = min(t0, float(send.min()))
            fin = np.asarray(w["finish_s"], dtype=float)[m]
            fin = fin[np.isfinite(fin)]
            if len(fin):
                t1 = max(t1, float(fin.max()))
        self.num_requests, self.num_warmup = n, warm
        self.request_itls = None if itls is None else [
            x for x, k in zip(itls, np.concatenate(masks) if masks else ()) if k]
        self.t0 = t0 if math.isfinite(t0) else 0.0
        self.duration_s = max(t1 - self.t0, 0.0) if math.isfinite(t1) else 0.0
        end = t1 if math.isfinite(t1) else self.t0  # steps from its first send to its end
        steps = parent.steps or {}
        self.counters = _window_counters(parent.counters, steps, self.t0, t1)
        if "time_s" in steps and len(steps["time_s"]):
            tt = np.asarray(steps["time_s"], dtype=float)
            sel = (tt >= self.t0) & (tt <= end)
            self.steps = {k: np.asarray(v)[sel] for k, v in steps.items()}
        else:
            self.steps = steps
        tok = parent.token_steps
        self.token_steps = None
        if tok is not None:
            self.token_steps = []
            for t, k in tok:
                sel = (t >= self.t0) & (t <= end)
                self.token_steps.append((t[sel], k[sel]))

    def iter_requests(self, rows: int | None = None):
        for w in self.parent.iter_requests(rows):
            m = self.keep(w)
            yield {k: np.asarray(v)[m] for k, v in w.items()}


_SPEC_COUNTERS = (("spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total"),
                  ("spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total"),
                  ("spec_decode_num_accepted_tokens",
                   "vllm:spec_decode_num_accepted_tokens_total"),
                  ("spec_decode_num_generation_tokens", "vllm:generation_tokens_total"))
_PER_POS = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{}"}}'


def _window_counters(counters: dict | None, steps: dict, t0: float, t1: float) -> dict | None:
    """The run's counters, the ``vllm:spec_decode_*`` ones as ``vllm bench serve`` reads them
    (the server's Prometheus counters fetched before and after its measured run): their growth
    from the view's first send ``t0`` to its end ``t1``, read off the timeseries rows (the
    last row before ``t0``, the last at or before ``t1``; at the rows' interval when they
    are sampled). Other counters are the run's."""
    if not counters or "spec_decode_num_drafts" not in counters or not math.isfinite(t1) \
            or "vllm:spec_decode_num_drafts_total" not in steps:
        return counters
    tt = np.asarray(steps["time_s"], dtype=float)
    i0 = int(np.searchsorted(tt, t0, side="left")) - 1
    i1 = int(np.searchsorted(tt, t1, side="right")) - 1

    def grown(col: str) -> int:
        v = np.asarray(steps[col], dtype=float)
        return int((v[i1] if i1 >= 0 else 0.0) - (v[i0] if i0 >= 0 else 0.0))

    out = dict(counters)
    for key, col in _SPEC_COUNTERS:
        out[key] = grown(col)
    out["spec_decode_num_accepted_tokens_per_pos"] = [
        grown(_PER_POS.format(i)) for i in range(len(counters[
            "spec_decode_num_accepted_tokens_per_pos"]))]
    return out


def _not_warmup(w: dict) -> np.ndarray:
    return ~np.asarray(w["warmup"], dtype=bool)


def _merged_itl(dists: list) -> Distribution | None:
    """One Distribution of several exact ones (None if any is sketched or none given)."""
    if not dists or any(not d.exact for d in dists):
        return None
    out = Distribution()
    for d in dists:
        v, c = d.exact_sample()
        if len(v):
            out.add(v, c)
    return out


def measured_view(result: RunResult):
    """``result`` itself for plain runs (and runs with timeouts only), else the view of its
    non-warm-up requests; ITL from the samples of the non-warm-up stages."""
    if not getattr(result, "client_columns", False):
        return result
    meta = result.workload_meta or {}
    plan = meta.get("stages") or []
    if not plan and not meta.get("warmup"):
        return result
    itl = None
    stage_itl = getattr(result, "stage_itl", None) or {}
    if plan and any(st["warmup"] for st in plan):
        itl = _merged_itl([d for k, d in sorted(stage_itl.items())
                           if k < len(plan) and not plan[k]["warmup"]])
    view = _View(result, _not_warmup, itl, {})
    view.workload_meta["num_prompts"] = view.num_requests
    return view
