"""The run's metrics recorder: per-request and per-step records of the engine and client.

:class:`Recorder` keeps vLLM-bench-style request rows and the engine's per-step rows
(``SchedulerStats``-like gauges and counters) in columnar buffers, with ITL samples, and hands
them on in chunks (to a ``RequestLog``, a ``Distribution``, a ``StepSampler``, a sink)."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

from servesim.simulator.request import Request

if TYPE_CHECKING:
    from servesim.simulator.metrics import Distribution
_NAN = float("nan")


class Recorder:
    """Columnar per-request and per-step records (array appends only on the hot path).

    Every ``chunk_rows`` ended requests (and every ``chunk_rows`` steps) the buffers are
    handed on and cleared in place: request rows to ``log`` (a
    :class:`~servesim.simulator.metrics.RequestLog`, which spills to disk for large runs),
    ITL samples to ``itl`` and step rows to ``steps`` (a ``StepSampler``), so memory stays
    bounded however long the run."""

    REQ = ("index", "arrival_s", "send_s", "prompt_len", "output_len", "num_cached_tokens",
           "first_scheduled_s", "first_token_s", "finish_s", "num_preemptions", "stage",
           "warmup", "attempts",
           # frontend (simulator/frontend.py) and engine-side times
           "frontend_arrival_s", "tokenized_s", "queued_s", "engine_first_token_s",
           "engine_finish_s", "first_token_iter_s", "finish_iter_s")
    SINK_ROWS = 4096  # request rows handed to ``sink`` at a time
    STEP = ("time_s", "step_seconds", "step_tokens", "running", "waiting", "kv_usage",
            "preemptions", "prefix_queries", "prefix_hits", "num_decode", "prefill_tokens",
            "generated")

    def __init__(self, log=None, itl=None, steps=None, chunk_rows: int | None = None):
        from servesim.simulator.metrics import CHUNK_ROWS, Distribution, RequestLog

        self.log = log if log is not None else RequestLog()
        self.itl = itl if itl is not None else Distribution()
        self.steps = steps  # a StepSampler, or None to keep step rows in ``step``
        self.chunk_rows = chunk_rows or CHUNK_ROWS
        self.req = {k: array("d") for k in self.REQ}
        # (the columns are cleared in place, so their bound appends stay valid)
        self._req_appends = tuple(self.req[k].append for k in self.REQ)
        self.request_id: list[str] = []
        self.reason: list[str] = []
        self.error: list[str] = []
        self.step = {k: array("d") for k in self.STEP}
        self.itl_explicit: list[float] = []
        self.itl_weighted: list[tuple[float, int]] = []
        # With a frontend: the engine's own inter-token gaps ((value, count) pairs; the lists
        # above then hold the client's) and the per-step hook (Frontend.on_step).
        self.engine_itl = Distribution()
        self.engine_itl_pairs: list[tuple[float, int]] = []
        self.on_step: Callable | None = None
        self.parked = None  # the client's Parked queue (counted as waiting), if any
        # Data parallel (several engines recording here): one slot per engine with its latest
        # (running, waiting, KV usage, preemptions, prefix queries, prefix hits); step rows
        # then hold the sums over engines (KV usage: the mean). None: one engine.
        self.engine_rows: list[tuple] | None = None
        self.refill: Callable[[], None] | None = None  # moves parked requests in
        # Staged runs (simulator/client_control.py): ITL samples per stage, split at stage
        # starts (samples are attributed to the stage during which they were emitted).
        self.itl_stage: int | None = None
        self.stage_itl: dict[int, Distribution] = {}
        # Extra timeseries columns (speculative decoding / LoRA counters):
        # ``on_step_columns(out)`` appends one value to each of them after every step row.
        self.on_step_columns: Callable | None = None
        # Also hands request rows (raw fields, as they end) and step rows to this callable in
        # batches, ("rows", {field: values}) and ("steps", {column: values}), e.g.
        # ``reports.writers.RequestsCsvStream`` (the CSV files written meanwhile).
        self.sink: Callable[[tuple], None] | None = None
        self._shipped = 0  # buffered request rows already handed to the sink
        # output.save_detailed: request index → its client-side inter-token gaps
        self.request_itls: dict[int, list[float]] | None = None
        self._steps_shipped = 0  # buffered step rows already handed to the sink

    def add_step_columns(self, names, on_step: Callable) -> list:
        """Add step columns ``names`` (after ``STEP``); ``on_step(out)`` fills them after every
        step. Returns the column arrays, in order."""
        cols = []
        for k in names:
            self.step[k] = array("d")
            cols.append(self.step[k])
        self.on_step_columns = on_step
        return cols

    def record_request(self, r: Request, reason: str) -> None:
        (a_index, a_arrival, a_send, a_prompt, a_output, a_cached, a_sched, a_first, a_finish,
         a_preempt, a_stage, a_warmup, a_attempts, a_fe_arrival, a_tok, a_queued, a_e_first,
         a_e_fin, a_it_first, a_it_fin) = self._req_appends
        a_index(r.index)
        if self.request_itls is not None:  # (a copy: batches in flight may still append to
            # the list of a request the client gave up on; those gaps never reach it)
            self.request_itls[r.index] = r.itls[:] if r.itls else array("d")
        a_arrival(r.spec.arrival_s)
        a_send(r.send_time)
        a_prompt(r.prompt_len)
        a_output(r.num_output_tokens)
        a_cached(r.num_cached_tokens if r.num_cached_tokens > 0 else 0)
        a_sched(r.first_scheduled_time)
        a_first(r.first_token_time)
        a_finish(r.finish_time)
        a_preempt(r.num_preemptions)
        extra = r.spec.extra  # client fields (staged runs, warm-up, retries)
        a_stage(extra.get("stage", 0))
        a_warmup(1.0 if extra.get("warmup") else 0.0)
        a_attempts(extra.get("attempts", 1))
        a_fe_arrival(r.arrival_time)
        fe = r.fe  # frontend.FE_*: server, tokenized, queued, engine first/last token, ...
        if fe is None:
            tok = r.send_time
            queued = r.queued_time if r.queued_time == r.queued_time else tok  # (NaN: never)
            e_first = it_first = e_fin = it_fin = _NAN
        else:
            _, tok, queued, e_first, it_first, e_fin, it_fin = fe[:7]  # (+ stream state)
        a_tok(tok)
        a_queued(queued)
        a_e_first(e_first)
        a_e_fin(e_fin)
        a_it_first(it_first)
        a_it_fin(it_fin)
        self.request_id.append(r.request_id)
        self.reason.append(reason)
        self.error.append(r.error)
        n = len(self.request_id)
        if n >= self.chunk_rows:
            self.flush()
        elif self.sink is not None and n - self._shipped >= self.SINK_ROWS:
            self._ship(n)

    def _ship(self, n: int) -> None:
        import numpy as np

        a = self._shipped
        rows = {k: np.frombuffer(v, dtype=float)[a:n].copy() for k, v in self.req.items()}
        rows["request_id"] = self.request_id[a:n]
        rows["finished_reason"] = self.reason[a:n]
        rows["error"] = self.error[a:n]
        self._shipped = n
        self.sink(("rows", rows))

    def ship_steps(self, n: int) -> None:
        import numpy as np

        a = self._steps_shipped
        rows = {k: np.frombuffer(v, dtype=float)[a:n].copy() for k, v in self.step.items()}
        self._steps_shipped = n
        self.sink(("steps", rows))

    def flush(self) -> None:
        """Hand the buffered rows and samples on; clear the buffers in place (the replicas'
        step closures and the scheduler hold references to them)."""
        import numpy as np

        if self.request_id:
            if self.sink is not None and self._shipped < len(self.request_id):
                self._ship(len(self.request_id))
            self._shipped = 0
            chunk = {k: np.frombuffer(v, dtype=float).copy() for k, v in self.req.items()}
            chunk["request_id"] = np.asarray(self.request_id, dtype=object)
            chunk["finished_reason"] = np.asarray(self.reason, dtype=object)
            chunk["error"] = np.asarray(self.error, dtype=object)
            self.log.append(chunk)
            for v in self.req.values():
                del v[:]
            del self.request_id[:], self.reason[:], self.error[:]
        self.flush_itl()
        if self.steps is not None:
            self.flush_steps()

    def flush_itl(self) -> None:
        import numpy as np

        stage = None
        if self.itl_stage is not None:
            stage = self.stage_itl.get(self.itl_stage)
            if stage is None:
                from servesim.simulator.metrics import Distribution

                stage = self.stage_itl[self.itl_stage] = Distribution()
        if self.itl_explicit:
            vals = np.asarray(self.itl_explicit, dtype=float)
            self.itl.add(vals)
            if stage is not None:
                stage.add(vals)
            del self.itl_explicit[:]
        if self.itl_weighted:
            pairs = np.asarray(self.itl_weighted, dtype=float).reshape(-1, 2)
            self.itl.add(pairs[:, 0], pairs[:, 1], group=1)
            if stage is not None:
                stage.add(pairs[:, 0], pairs[:, 1], group=1)
            del self.itl_weighted[:]
        if self.engine_itl_pairs:
            pairs = np.asarray(self.engine_itl_pairs, dtype=float).reshape(-1, 2)
            self.engine_itl.add(pairs[:, 0], pairs[:, 1])
            del self.engine_itl_pairs[:]

    def flush_steps(self) -> None:
        import numpy as np

        n = len(self.step["time_s"])
        if self.sink is not None and self._steps_shipped < n:
            self.ship_steps(n)
        self._steps_shipped = 0
        if n:
            self.steps.add({k: np.frombuffer(v, dtype=float).copy()
                            for k, v in self.step.items()})
            for v in self.step.values():
                del v[:]
