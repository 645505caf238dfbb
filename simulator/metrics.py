"""What one simulated run produces, in columnar form (the contract with ``reports/``).

Units: seconds and tokens. ``reports/`` turns a :class:`RunResult` into ``result.json``
(vLLM bench schema, milliseconds there), ``requests.csv`` and ``timeseries.csv``.

Bounded memory at any scale: the engine's :class:`~servesim.simulator.recorder.Recorder` hands
per-request rows to a :class:`RequestLog` in chunks of :data:`CHUNK_ROWS` as requests end; up
to :data:`EXACT_REQUESTS` rows stay in memory (``RunResult.requests`` is then a plain dict and
every metric is exact), beyond that the chunks are spilled to ``.npy`` files and consumers
stream them (``RunResult.iter_requests``); latency percentiles then come from a
:class:`Distribution` (exact count/mean/std, DDSketch percentiles, relative accuracy
:data:`SKETCH_RELATIVE_ACCURACY`), flagged in ``result.json``.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# requests.csv columns, in order (finished_reason: stop | length | abort | rejected | in_flight)
REQUEST_COLUMNS = (
    "request_id",
    "arrival_s",
    "prompt_len",
    "output_len",
    "num_cached_tokens",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "ttft_s",
    "tpot_s",
    "e2el_s",
    "queue_s",
    "num_preemptions",
    "finished_reason",
)

# timeseries.csv columns (vLLM Prometheus names where one exists)
STEP_COLUMNS = (
    "time_s",  # simulated time at the end of the step
    "step_seconds",
    "step_tokens",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",  # 0..1, used / total blocks (null block excluded)
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "num_decode_reqs",
    "num_prefill_tokens",
    "num_generated_tokens",  # tokens sampled in the step (first tokens included)
)

# Runs where a chunk may carry several tokens (speculative decoding, stream_interval > 1):
# the SSE chunks of each step, as ``vllm bench serve``'s peak output rate counts them
CHUNKS_COLUMN = "num_output_chunks"

# Raw per-request fields the engine records (floats), then the three string fields.
RAW_FIELDS = ("index", "arrival_s", "send_s", "prompt_len", "output_len", "num_cached_tokens",
              "first_scheduled_s", "first_token_s", "finish_s", "num_preemptions", "stage",
              "warmup", "attempts",
              "frontend_arrival_s", "tokenized_s", "queued_s", "engine_first_token_s",
              "engine_finish_s", "first_token_iter_s", "finish_iter_s")
# requests.csv columns of runs with a client control (stages, warm-up, timeouts), after the rest
CLIENT_COLUMNS = ("stage", "warmup", "attempts")
# Engine-side per-request columns (s), as vLLM's Prometheus histograms measure them:
# engine_ttft_s  = vllm:time_to_first_token_seconds   (output handler's iteration timestamp of
#                  the first token − the API server's arrival_time)
# engine_e2el_s  = vllm:e2e_request_latency_seconds   (same, for the last token)
# engine_tpot_s  = vllm:request_time_per_output_token_seconds (decode time / (outputs − 1); 0
#                  for a one-token request, as vLLM observes it)
# queue_s        = vllm:request_queue_time_seconds    (first scheduled − queued in the engine)
# prefill_s      = vllm:request_prefill_time_seconds  (first token − first scheduled, engine)
# decode_s       = vllm:request_decode_time_seconds   (last token − first token, engine)
# Without a frontend the engine times are the client's (arrival = send); queued is when the
# engine loop takes the request in (the send, or the end of the step running then).
ENGINE_COLUMNS = ("engine_ttft_s", "engine_e2el_s", "engine_tpot_s", "prefill_s", "decode_s")
RAW_STRINGS = ("request_id", "finished_reason", "error")
COMPLETED_REASONS = ("stop", "length")

CHUNK_ROWS = 65_536  # rows per RequestLog chunk (≈ 5 MB of doubles)
EXACT_REQUESTS = 1_000_000  # above this many requests: spill to disk, sketch percentiles
EXACT_SAMPLES = 2_000_000  # a Distribution keeps this many raw samples, then sketches
SKETCH_RELATIVE_ACCURACY = 0.001  # DDSketch alpha: |estimate - x_rank| <= alpha * x_rank


def derive_request_columns(raw: Mapping[str, np.ndarray],
                           client_columns: bool = False) -> dict[str, np.ndarray]:
    """Raw engine fields of some requests → the ``RunResult.requests`` columns.

    TTFT = first token − send, E2EL = finish − send (client-visible times; NaN unless
    finished stop/length; ``finish_s`` of a failed request is when it ended for the client),
    TPOT = (E2EL − TTFT) / (output_len − 1) for output_len > 1, queue = first scheduled −
    queued in the engine; engine-side columns: ``ENGINE_COLUMNS``.
    Row-wise, so any window of rows gives the same values as the whole run. ``client_columns``
    adds ``stage`` (load stage index), ``warmup`` (bool: excluded from the metrics) and
    ``attempts`` (sends, > 1 after timeouts with retries) for runs that use them."""
    send = raw["send_s"]
    reason = raw["finished_reason"]
    out = raw["output_len"]
    ok = np.isin(reason, COMPLETED_REASONS)
    ttft = np.where(ok, raw["first_token_s"] - send, np.nan)
    e2el = np.where(ok, raw["finish_s"] - send, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(ok & (out > 1), (e2el - ttft) / np.maximum(out - 1, 1), np.nan)
    e_first = raw.get("engine_first_token_s")
    if e_first is None:  # rows written before the frontend existed
        n = len(send)
        e_first = e_fin = it_first = it_fin = np.full(n, np.nan)
        arrival = queued = send
    else:
        e_fin, it_first, it_fin = (raw["engine_finish_s"], raw["first_token_iter_s"],
                                   raw["finish_iter_s"])
        arrival, queued = raw["frontend_arrival_s"], raw["queued_s"]
    e_first = np.where(np.isnan(e_first), raw["first_token_s"], e_first)
    e_fin = np.where(np.isnan(e_fin), raw["finish_s"], e_fin)
    it_first = np.where(np.isnan(it_first), raw["first_token_s"], it_first)
    it_fin = np.where(np.isnan(it_fin), raw["finish_s"], it_fin)
    decode = np.where(ok, e_fin - e_first, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        # (vLLM FinishedRequestStats: 0 for a one-token request, observed like any other)
        e_tpot = np.where(ok, np.where(out > 1, decode / np.maximum(out - 1, 1), 0.0), np.nan)
    return {
        "request_id": raw["request_id"],
        "arrival_s": raw["arrival_s"],
        "prompt_len": raw["prompt_len"].astype(np.int64),
        "output_len": out.astype(np.int64),
        "num_cached_tokens": raw["num_cached_tokens"].astype(np.int64),
        "first_scheduled_s": raw["first_scheduled_s"],
        "first_token_s": raw["first_token_s"],
        # (a failed request's: when the client got its error or gave up; NaN if never)
        "finish_s": raw["finish_s"],
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2el_s": e2el,
        "queue_s": raw["first_scheduled_s"] - queued,
        "num_preemptions": raw["num_preemptions"].astype(np.int64),
        "finished_reason": reason,
        "send_s": send,
        "error": raw["error"],
        "engine_ttft_s": np.where(ok, it_first - arrival, np.nan),
        "engine_e2el_s": np.where(ok, it_fin - arrival, np.nan),
        "engine_tpot_s": e_tpot,
        "prefill_s": np.where(ok, e_first - raw["first_scheduled_s"], np.nan),
        "decode_s": decode,
        # the frontend's timestamps (TTFT breakdown, reports)
        "frontend_arrival_s": arrival,
        "tokenized_s": raw.get("tokenized_s", send),
        "queued_s": queued,
        "engine_first_token_s": e_first,
        "first_token_iter_s": it_first,
    } | ({"stage": np.asarray(raw["stage"]).astype(np.int64),
          "warmup": np.asarray(raw["warmup"]) > 0,
          "attempts": np.asarray(raw["attempts"]).astype(np.int64)} if client_columns else {})


class RequestLog:
    """Per-request raw rows in chunks, in memory up to ``spill_rows`` rows, then on disk.

    Chunks arrive in end order, each sorted by request index; indices over the whole log are
    a permutation of 0..n-1, so :meth:`windows` reassembles index order one window at a time
    (memory: one window plus one chunk). Spilled chunks are ``.npy`` files in ``spool_dir``
    (or a temporary folder), removed by :meth:`close` or when the log is garbage-collected."""

    def __init__(self, spool_dir: str | Path | None = None, spill_rows: int | None = None):
        self.spill_rows = EXACT_REQUESTS if spill_rows is None else spill_rows
        self._spool_parent = spool_dir
        self._dir: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._mem: list[dict[str, np.ndarray]] = []
        self._ranges: list[tuple[int, int]] = []  # (min index, max index) per chunk
        self.num_rows = 0
        self.max_finish = -math.inf  # latest end of any request, completed or failed (s)

    @property
    def spilled(self) -> bool:
        return self._dir is not None

    def append(self, chunk: dict[str, np.ndarray]) -> None:
        """Add rows (raw fields as arrays of equal length, any order)."""
        n = len(chunk["index"])
        if n == 0:
            return
        order = np.argsort(chunk["index"], kind="stable")
        chunk = {k: np.asarray(v)[order] for k, v in chunk.items()}
        idx = chunk["index"]
        fin = np.asarray(chunk["finish_s"], dtype=float)
        fin = fin[np.isfinite(fin)]  # (failed: when the client got its error or gave up)
        if len(fin):
            self.max_finish = max(self.max_finish, float(fin.max()))
        self._ranges.append((int(idx[0]), int(idx[-1])))
        self.num_rows += n
        if self._dir is None and self.num_rows > self.spill_rows:
            self._start_spill()
        if self._dir is None:
            self._mem.append(chunk)
        else:
            self._write(len(self._ranges) - 1, chunk)

    def _start_spill(self) -> None:
        parent = self._spool_parent
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix=".servesim-requests-", dir=parent)
        self._dir = Path(self._tmp.name)
        for k, chunk in enumerate(self._mem):
            self._write(k, chunk)
        self._mem = []

    def _write(self, k: int, chunk: dict[str, np.ndarray]) -> None:
        num = np.stack([np.asarray(chunk[f], dtype=float) for f in RAW_FIELDS], axis=1)
        np.save(self._dir / f"{k}.num.npy", num)  # rows contiguous: a window is one slice
        np.save(self._dir / f"{k}.index.npy", np.asarray(chunk["index"], dtype=float))
        for s in RAW_STRINGS:
            np.save(self._dir / f"{k}.{s}.npy", np.asarray(chunk[s]).astype(str))

    def _read(self, k: int, lo_index: int, hi_index: int) -> dict[str, np.ndarray]:
        """Rows of chunk ``k`` with lo_index <= index < hi_index."""
        if self._dir is None:
            c = self._mem[k]
            a, b = np.searchsorted(c["index"], [lo_index, hi_index])
            return {f: v[a:b] for f, v in c.items()}
        idx = np.load(self._dir / f"{k}.index.npy", mmap_mode="r")
        a, b = np.searchsorted(idx, [lo_index, hi_index])  # touches O(log n) pages
        del idx
        if b <= a:
            return _empty_raw()
        num = np.load(self._dir / f"{k}.num.npy", mmap_mode="r")
        rows = np.array(num[a:b])
        del num  # unmap: pages read stay out of the resident set
        out = {f: rows[:, i] for i, f in enumerate(RAW_FIELDS)}
        for s in RAW_STRINGS:
            col = np.load(self._dir / f"{k}.{s}.npy", mmap_mode="r")
            out[s] = np.array(col[a:b]).astype(object)
            del col
        return out

    def windows(self, rows: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Raw rows in request-index order, ``rows`` (default CHUNK_ROWS) at a time."""
        n = self.num_rows
        rows = rows or CHUNK_ROWS
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            parts = [self._read(k, lo, hi) for k, (a, b) in enumerate(self._ranges)
                     if a < hi and b >= lo]
            win = {f: np.concatenate([p[f] for p in parts]) for f in RAW_FIELDS + RAW_STRINGS}
            order = np.argsort(win["index"], kind="stable")
            yield {f: v[order] for f, v in win.items()}

    def all_rows(self) -> dict[str, np.ndarray]:
        """Every row in index order (O(n) memory)."""
        if not self.num_rows:
            return {f: np.zeros(0) for f in RAW_FIELDS} | {
                s: np.zeros(0, dtype=object) for s in RAW_STRINGS}
        return next(self.windows(rows=self.num_rows))

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
        self._tmp = self._dir = None
        self._mem, self._ranges, self.num_rows = [], [], 0


class LazyRequests(Mapping):
    """``RunResult.requests`` of a spilled run: each column is assembled from the spool when
    read (O(n) for that column only). Prefer ``RunResult.iter_requests`` for streaming."""

    def __init__(self, log: RequestLog, client_columns: bool = False):
        self._log = log
        self._client = client_columns
        self._keys = tuple(derive_request_columns(_empty_raw(), client_columns))

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in self._keys:
            raise KeyError(key)
        parts = [derive_request_columns(w, self._client)[key] for w in self._log.windows()]
        return np.concatenate(parts) if parts else np.zeros(0)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _empty_raw() -> dict[str, np.ndarray]:
    return {f: np.zeros(0) for f in RAW_FIELDS} | {s: np.zeros(0, dtype=object)
                                                   for s in RAW_STRINGS}


class Distribution:
    """A (weighted) sample of latencies: exact while it holds at most ``exact_limit`` stored
    values, then a DDSketch (``ddsketch`` package) plus exact streaming count, mean and
    population std (Chan et al.'s pairwise update). Values are seconds, NaN ignored."""

    def __init__(self, exact_limit: int | None = None,
                 relative_accuracy: float = SKETCH_RELATIVE_ACCURACY):
        self.exact_limit = EXACT_SAMPLES if exact_limit is None else exact_limit
        self.relative_accuracy = relative_accuracy
        self._parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._stored = 0
        self.sketch = None  # DDSketch once the exact limit is passed
        self.count = 0.0
        self.mean = 0.0
        self._m2 = 0.0

    @property
    def exact(self) -> bool:
        return self.sketch is None

    def add(self, values: np.ndarray, counts: np.ndarray | None = None, group: int = 0) -> None:
        """Add samples (``counts``: multiplicities, default 1). The exact sample lists groups
        in ``group`` order, each in insertion order."""
        values = np.asarray(values, dtype=float)
        if not len(values):
            return
        if self.sketch is None:  # stored as given (NaN included), counts None = all ones
            self._parts.setdefault(group, []).append((values, counts))
            self._stored += len(values)
            if self._stored > self.exact_limit:
                self._to_sketch()
            return
        self._stream(values, counts)

    def _to_sketch(self) -> None:
        from ddsketch import DDSketch

        self.sketch = DDSketch(self.relative_accuracy)
        values, counts = self.exact_sample()
        self._parts, self._stored = {}, 0
        for lo in range(0, len(values), CHUNK_ROWS):
            self._stream(values[lo:lo + CHUNK_ROWS], counts[lo:lo + CHUNK_ROWS])

    def _stream(self, values: np.ndarray, counts: np.ndarray | None) -> None:
        from ddsketch import DDSketch, LogarithmicMapping
        from ddsketch.ddsketch import BaseDDSketch
        from ddsketch.store import DenseStore

        counts = np.ones(len(values)) if counts is None else np.asarray(counts, dtype=float)
        keep = np.isfinite(values) & (counts > 0)
        if not keep.all():
            values, counts = values[keep], counts[keep]
        if not len(values):
            return
        # moments (Chan et al.): merge (n, mean, M2) of this batch into the running ones
        n_b = float(counts.sum())
        mean_b = float(np.sum(values * counts) / n_b)
        m2_b = float(np.sum(counts * (values - mean_b) ** 2))
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self._m2 += m2_b + delta * delta * self.count * n_b / n
        self.count = n
        # sketch: bucket keys as LogarithmicMapping.key (ceil(log_gamma(v))), vectorised
        mapping = LogarithmicMapping(self.relative_accuracy)
        pos = values > mapping.min_possible
        keys = np.ceil(np.log(values[pos]) / math.log(mapping.gamma)).astype(np.int64)
        uniq, inv = np.unique(keys, return_inverse=True)
        weights = np.bincount(inv, weights=counts[pos])
        store = DenseStore()
        for k, w in zip(uniq.tolist(), weights.tolist()):
            store.add(k, w)
        zero = float(counts[~pos].sum())
        part = BaseDDSketch(mapping, store, DenseStore(), zero)
        assert isinstance(self.sketch, DDSketch)
        self.sketch.merge(part)

    def exact_sample(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, counts) in insertion order (exact mode only)."""
        parts = [p for g in sorted(self._parts) for p in self._parts[g]]
        if not parts:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        return (np.concatenate([v for v, _ in parts]),
                np.concatenate([np.ones(len(v), np.int64) if c is None else
                                np.asarray(c).astype(np.int64) for v, c in parts]))

    def values(self) -> np.ndarray:
        """The exact sample of an unweighted distribution, in insertion order."""
        return self.exact_sample()[0]

    def std(self) -> float:
        return math.sqrt(self._m2 / self.count) if self.count else 0.0

    def quantile(self, q: float) -> float:
        """Sketch estimate of the rank-⌊q·(n−1)⌋ value (relative error ≤ alpha)."""
        v = self.sketch.get_quantile_value(q) if self.count else None
        return float(v) if v is not None else 0.0


@dataclass
class RunResult:
    """Everything a run measured.

    - ``requests``: column name → array, one entry per request of the workload (finished,
      rejected or still in flight at the end), in request-index order. ``send_s`` (when the
      client actually sent it: later than ``arrival_s`` under ``max_concurrency``) and
      ``error`` are extra columns. Latencies (``ttft_s``, ``e2el_s``, ``queue_s``) are measured
      from ``send_s`` like ``vllm bench serve``; NaN where undefined (rejected, or ``tpot_s``
      with one output token). A plain dict for runs of up to :data:`EXACT_REQUESTS` requests;
      above, a :class:`LazyRequests` mapping that assembles a column from disk when read.
      Streaming consumers use :meth:`iter_requests` (same columns, windows of rows).
    - ``itl_values`` / ``itl_counts``: the pooled inter-token latencies of all requests as a
      weighted sample (value, multiplicity); expand with ``np.repeat`` for exact percentiles.
      Empty when ``itl_stream`` holds them instead (more than :data:`EXACT_SAMPLES` entries).
    - ``steps``: column name (``STEP_COLUMNS``) → array, one entry per recorded sample.
    - ``token_steps``: (``time_s``, ``num_generated_tokens``) array chunks of every step that
      sampled a token, when ``steps`` holds sampled rows (``output.timeseries_interval_s``,
      or long runs); else None.
    - ``counters``: totals (``num_preemptions``, ``prefix_cache_queries``, ``prefix_cache_hits``,
      ``num_steps``, ``num_gpu_blocks``, ``wall_seconds``, ...).
    - ``workload_meta``: the workload's bench traffic fields (``num_prompts``,
      ``request_rate``, ``burstiness``, ``max_concurrency``, ``dataset_name``).
    - ``capacity``: the memory plan as a dict (weights per GPU, KV bytes per token, ...).
    - ``request_log`` / ``itl_stream``: the streaming stores behind large runs (None for runs
      built in memory); :meth:`close` removes the spool files.
    """

    config: Any  # resolved ExperimentConfig
    requests: Mapping[str, np.ndarray]
    itl_values: np.ndarray
    itl_counts: np.ndarray
    steps: dict[str, np.ndarray]
    token_steps: list[tuple[np.ndarray, np.ndarray]] | None = None
    counters: dict[str, float] = field(default_factory=dict)
    workload_meta: dict[str, Any] = field(default_factory=dict)
    capacity: dict[str, Any] = field(default_factory=dict)
    request_log: RequestLog | None = None
    itl_stream: Distribution | None = None
    # Runs with a client control (stages, warm-up, timeouts): requests carry the
    # CLIENT_COLUMNS, and ``stage_itl`` holds the ITL samples emitted during each stage.
    client_columns: bool = False
    stage_itl: dict[int, Distribution] | None = None
    # Cluster runs (simulator/cluster/): one RunResult per instance, written under
    # ``instances/<name>/``; keys added to result.json after servesim's extras; extra files
    # (name → text) such as ``routing.csv``. Empty for single-engine runs.
    instances: list[tuple[str, RunResult]] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    engine_itl: Distribution | None = None  # engine-side inter-token gaps (with a frontend)
    frontend: dict[str, Any] = field(default_factory=dict)  # enable, params, provenance
    # output.save_detailed: each request's client-side inter-token gaps (s), in row order
    request_itls: list[list[float]] | None = None

    @property
    def num_requests(self) -> int:
        if self.request_log is not None and self.request_log.spilled:
            return self.request_log.num_rows
        return len(self.requests["finished_reason"])

    @property
    def streamed(self) -> bool:
        """True when per-request rows live on disk (more than EXACT_REQUESTS requests)."""
        return self.request_log is not None and self.request_log.spilled

    def iter_requests(self, rows: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """``requests`` columns in windows of ``rows`` rows (all at once when None and the
        run is in memory), in request-index order."""
        if self.streamed:
            for w in self.request_log.windows(rows or CHUNK_ROWS):
                yield derive_request_columns(w, self.client_columns)
            return
        req = self.requests
        n = len(req["finished_reason"])
        step = rows or max(n, 1)
        for lo in range(0, max(n, 1), step):
            yield {k: np.asarray(v)[lo:lo + step] for k, v in req.items()}

    @property
    def duration_s(self) -> float:
        """Benchmark duration like vllm bench: from the benchmark start (t = 0, before the
        first send) until every request has ended (``asyncio.gather`` returns: the latest
        ``finish_s``, a completion's or a failure's), in seconds."""
        if self.streamed:
            m = self.request_log.max_finish
            return m if math.isfinite(m) else 0.0
        ends = np.asarray(self.requests["finish_s"], dtype=float)
        ends = ends[np.isfinite(ends)]
        return float(ends.max()) if len(ends) else 0.0

    def close(self) -> None:
        """Remove the spooled per-request files (large runs)."""
        if self.request_log is not None:
            self.request_log.close()
        for _, sub in self.instances:
            sub.close()

