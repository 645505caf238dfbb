"""One-pass, bounded-memory trace statistics (``simulate trace stats``).

Approach:

- Counts, duration, mean rate and inter-arrival CV from running sums (Chan's parallel
  mean/variance merge over 64k-row batches), so memory does not grow with the row count.
- Length percentiles are *exact* for any number of rows: lengths are integers, so we keep a
  histogram (``np.bincount``, one counter per distinct length up to 2^24 tokens, a dict above)
  and read percentiles from it with numpy's ``linear`` rule. Memory is O(largest length).
- Prefix-reuse potential at a block size: the fraction of full prompt blocks whose
  prefix-chained id (hash of all ids up to and including that block, as vLLM chains block
  hashes) was seen in an earlier request; a request's prompt *and* output blocks are then
  marked seen. Exact (a Python set) up to ``SEEN_EXACT_MAX`` distinct blocks, then a 64 MiB
  Bloom filter (flagged ``prefix_reuse_approximate``; false-positive rate < 1% up to ~50M
  blocks). Formats without prefix ids (Azure, BurstGPT, ...) have no reuse information: 0.
"""

from __future__ import annotations

import math

import numpy as np
from servesim.workloads.importers import detect_format, read_trace

BATCH = 65536
HIST_MAX = 1 << 24
SEEN_EXACT_MAX = 2_000_000
BLOOM_BITS = 1 << 29
BLOOM_K = 4


class LengthHistogram:
    """Exact integer histogram with numpy-``linear`` percentiles."""

    def __init__(self):
        self.counts = np.zeros(1024, dtype=np.int64)
        self.big: dict[int, int] = {}
        self.n = 0
        self.total = 0

    def add(self, x: np.ndarray) -> None:
        if not len(x):
            return
        self.n += len(x)
        self.total += int(x.sum())
        big = x >= HIST_MAX
        if big.any():
            for v in x[big].tolist():
                self.big[v] = self.big.get(v, 0) + 1
            x = x[~big]
        if not len(x):
            return
        c = np.bincount(x)
        if len(c) > len(self.counts):
            grown = np.zeros(max(len(c), 2 * len(self.counts)), dtype=np.int64)
            grown[: len(self.counts)] = self.counts
            self.counts = grown
        self.counts[: len(c)] += c

    def _values_counts(self) -> tuple[np.ndarray, np.ndarray]:
        v = np.nonzero(self.counts)[0]
        c = self.counts[v]
        if self.big:
            bv = np.array(sorted(self.big), dtype=np.int64)
            v = np.concatenate([v, bv])
            c = np.concatenate([c, np.array([self.big[k] for k in bv.tolist()], dtype=np.int64)])
        return v, c

    def percentiles(self, qs) -> list[float]:
        """np.percentile(values, q, method="linear") for each q."""
        if self.n == 0:
            return [math.nan for _ in qs]
        v, c = self._values_counts()
        cum = np.cumsum(c)
        out = []
        for q in qs:
            pos = q / 100 * (self.n - 1)
            k = math.floor(pos)
            frac = pos - k
            lo = v[np.searchsorted(cum, k + 1)]
            hi = v[np.searchsorted(cum, min(k + 2, self.n))]
            out.append(float(lo + (hi - lo) * frac))
        return out

    def max(self) -> int:
        v, _ = self._values_counts()
        return int(v[-1]) if len(v) else 0


class _Moments:
    """Running count/mean/M2 merged batch by batch (Chan et al.)."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: np.ndarray) -> None:
        if not len(x):
            return
        nb, mb = len(x), float(x.mean())
        m2b = float(((x - mb) ** 2).sum())
        n = self.n + nb
        d = mb - self.mean
        self.mean += d * nb / n
        self.m2 += m2b + d * d * self.n * nb / n
        self.n = n

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.n) if self.n else math.nan


class SeenBlocks:
    """Set of prefix-chained block hashes: exact, then a Bloom filter past a size cap."""

    def __init__(self, exact_max: int = SEEN_EXACT_MAX):
        self.exact: set[int] | None = set()
        self.exact_max = exact_max
        self.bits: np.ndarray | None = None

    @property
    def approximate(self) -> bool:
        return self.exact is None

    def _positions(self, hs: list[int]) -> np.ndarray:
        x = np.array(hs, dtype=np.uint64)
        pos = []
        for i in range(BLOOM_K):
            y = x * np.uint64(0x9E3779B97F4A7C15 + 2 * i + 1)
            y ^= y >> np.uint64(29)
            pos.append(y % np.uint64(BLOOM_BITS))
        return np.stack(pos)

    def _to_bloom(self) -> None:
        self.bits = np.zeros(BLOOM_BITS // 8, dtype=np.uint8)
        hs = list(self.exact)
        self.exact = None
        for i in range(0, len(hs), BATCH):
            self._bloom_add(hs[i : i + BATCH])

    def _bloom_add(self, hs: list[int]) -> None:
        p = self._positions(hs)
        np.bitwise_or.at(self.bits, (p >> np.uint64(3)).ravel(),
                         (np.uint8(1) << (p & np.uint64(7)).astype(np.uint8)).ravel())

    def _bloom_has(self, hs: list[int]) -> np.ndarray:
        p = self._positions(hs)
        b = self.bits[p >> np.uint64(3)] >> (p & np.uint64(7)).astype(np.uint8)
        return (b & 1).all(axis=0)

    def count_seen(self, hs: list[int]) -> int:
        if self.exact is not None:
            return sum(h in self.exact for h in hs)
        return int(self._bloom_has(hs).sum()) if hs else 0

    def add(self, hs: list[int]) -> None:
        if self.exact is not None:
            self.exact.update(hs)
            if len(self.exact) > self.exact_max:
                self._to_bloom()
        elif hs:
            self._bloom_add(hs)


def _chained(ids) -> list[int]:
    """Prefix-chained hashes: h_i = hash((h_{i-1}, id_i)), 64-bit, deterministic for ints."""
    out, h = [], 0
    for x in ids:
        h = hash((h, x)) & 0xFFFFFFFFFFFFFFFF
        out.append(h)
    return out


def trace_stats(path, format: str = "auto", *, block_size: int = 16,
                skip_bad_rows: bool = False, **opts) -> dict:
    """Statistics of a trace in one streaming pass (see module doc). Times in s, lengths in
    tokens; ``mean_rate_rps`` = (N−1)/duration; ``interarrival_cv`` = std/mean of the gaps."""
    fmt = detect_format(path) if format == "auto" else format
    meta: dict = {}
    pl, ol = LengthHistogram(), LengthHistogram()
    gaps = _Moments()
    seen = SeenBlocks()
    prompt_blocks = reused = 0
    has_ids = False
    first = last = None
    tb, pb, ob = [], [], []

    def flush():
        nonlocal last
        if not tb:
            return
        t = np.array(tb)
        prev = last if last is not None else t[0]
        gaps.add(np.diff(np.concatenate([[prev], t]))[0 if last is not None else 1 :])
        last = float(t[-1])
        pl.add(np.array(pb, dtype=np.int64))
        ol.add(np.array(ob, dtype=np.int64))
        tb.clear()
        pb.clear()
        ob.clear()

    from servesim.simulator.progress import phase

    with phase(f"reading {path}") as tick:
        for r in read_trace(path, fmt, block_size=block_size, skip_bad_rows=skip_bad_rows,
                            stats=meta, **opts):
            if first is None:
                first = r.arrival_s
            tb.append(r.arrival_s)
            pb.append(r.prompt_len)
            ob.append(r.output_len)
            nblk = r.prompt_len // block_size
            prompt_blocks += nblk
            ids = r.prefix_block_ids
            if ids:
                has_ids = True
                hs = _chained(ids)
                reused += seen.count_seen(hs[:nblk])
                seen.add(hs)
            tick(pl.n + len(tb))
            if len(tb) >= BATCH:
                flush()
    flush()
    n = pl.n
    duration = (last - first) if n else 0.0
    stamped = fmt != "sharegpt" and not (fmt == "vllm_result" and duration == 0)
    qs = (50, 90, 99)
    out = {
        "path": str(path),
        "format": fmt,
        "requests": n,
        "duration_s": duration if stamped else None,
        "mean_rate_rps": ((n - 1) / duration if duration > 0 else math.inf) if stamped else None,
        "interarrival_cv": (gaps.std / gaps.mean if gaps.mean > 0 else None) if stamped
        else None,
        "block_size": block_size,
        "prefix_reuse": (reused / prompt_blocks if prompt_blocks else 0.0) if has_ids else 0.0,
        "prefix_reuse_approximate": seen.approximate,
        "has_prefix_ids": has_ids,
    }
    for name, h in (("prompt_len", pl), ("output_len", ol)):
        p50, p90, p99 = h.percentiles(qs)
        out[name] = {"mean": h.total / h.n if h.n else math.nan, "p50": p50, "p90": p90,
                     "p99": p99, "max": h.max(), "total": h.total}
    for k in ("skipped_bad_rows", "dropped_failed", "filtered", "zero_output"):
        out[k] = meta.get(k, 0)
    return out
