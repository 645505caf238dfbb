"""Attention cost of one engine step, all layers: decode rows (roofline or the measured
decode table at the mean context), prefill chunks over their cached context (sliding
windows capped), speculative-decoding verification rows, and the latency floor shared by
the parts vLLM runs in one kernel call. :class:`AttentionCosts` is a base of
:class:`~servesim.costmodels.step.StepCostModel`; its coefficients (``_dF``, ``_dB``,
``_dBr``, ``_pF``, ``_pBkv``, ``_pBr``, ``_cal_dec``, ``_cal_pre``, ``_attn_floor``, ...) are
set in ``StepCostModel.__init__``."""

from __future__ import annotations


def _window_pairs(n: int, w: int | None) -> float:
    """Σ_{j=1..n} min(j, w): (query, key) pairs of the first n causal queries."""
    if w is None or n <= w:
        return n * (n + 1) / 2
    return w * (w + 1) / 2 + (n - w) * w


class AttentionCosts:
    """Decode, prefill and spec-decode attention seconds of ``StepCostModel``."""

    def _decode_attn(self, nd: int, ctx: int) -> float:
        """Decode attention, all layers (seconds): KV bytes read = Σ context · kv bytes/token."""
        if not self._cal_dec:
            x = ctx * self._dF
            y = ctx * self._dB + nd * self._dBr
            return max(y, x)
        return self._decode_cal(nd, ctx)[0]

    def _decode_cal(self, nd: int, ctx: int) -> tuple[float, str]:
        """Measured decode attention, all layers: one call of ``nd`` rows at the mean context
        (rounded to a multiple of 16 tokens), (seconds, provenance)."""
        key = (nd, (ctx // nd + 8) >> 4)
        got = self._dec_cache.get(key)
        if got is None:
            t, prov = self.calibration.decode(*self._layout, nd, max(1, key[1] << 4))
            got = self._dec_cache[key] = (self.L * t, prov)
        return got

    def _prefill_attn(self, c: int, p: int) -> float:
        """Prefill chunk of ``c`` new tokens after ``p`` cached ones (all layers, seconds):
        causal (query, key) pairs = c·p + c(c+1)/2 (window-capped), 4·heads·head_dim FLOPs each;
        bytes = cached + new KV read + q/o + KV write."""
        if not self._cal_pre:
            x, y = self._prefill_roof(c, p)
            return max(y, x)
        return self._prefill_cal(c, p)[0]

    def _prefill_roof(self, c: int, p: int) -> tuple[float, float]:
        """(FLOP seconds, byte seconds) of a prefill chunk of ``c`` new tokens after ``p``
        cached ones, all layers: causal (query, key) pairs = c·p + c(c+1)/2 (window-capped)
        at ``_pF`` s each; cached + new KV at ``_pBkv`` s per token, q/o rows at ``_pBr``."""
        w = self.window
        if w:
            pairs = _window_pairs(p + c, w) - _window_pairs(p, w)
            kv = min(p + c, w + c)
        else:
            pairs = c * p + c * (c + 1) / 2
            kv = p + c
        return pairs * self._pF, kv * self._pBkv + c * self._pBr

    def _prefill_compute_bound(self, c: int, p: int) -> bool:
        """Whether a chunk's attention is compute-bound (its FLOP time above its byte time)."""
        x, y = self._prefill_roof(c, p)
        return x > y

    def _prefill_cal(self, c: int, p: int) -> tuple[float, str]:
        """Measured prefill attention of one chunk, all layers (cached context in 16-token
        buckets), (seconds, provenance). A sliding window caps the cached context the chunk
        sees at ``window`` (and its causal pairs at the windowed count)."""
        key = (c, p >> 4)
        got = self._pre_cache.get(key)
        if got is None:
            p16 = key[1] << 4
            w = self.window
            pe = min(p16, w) if w else p16
            t, prov = self._cal_prefill(c, pe)
            if w and c > w:
                t *= (_window_pairs(p16 + c, w) - _window_pairs(p16, w)) / (
                    c * pe + c * (c + 1) / 2)
            got = self._pre_cache[key] = (self.L * t, prov)
        return got

    def _attn_shared(self, nd: int, n_pre: int) -> float:
        """Seconds of latency floor not paid twice: attention parts that vLLM runs in one
        kernel call per layer (all prefill chunks; with FlashAttention/Triton also the decode
        rows) pay the measured floor once (0 without measured attention)."""
        n = (n_pre - 1 if n_pre else 0) + (1 if nd and n_pre and self._attn_unified else 0)
        return n * self._attn_floor

    def _spec_decode_attn(self, nd: int, ns: int, ctx: int, t: float) -> float:
        """Decode attention ``t`` (nd rows of one query, Σ context ``ctx``) when the rows also
        verify ``ns`` draft tokens (vLLM: one attention call, query length 1 + k per row):
        the KV is read once, the q/o rows and KV writes grow by ``ns``, the FLOPs by the mean
        query length (nd + ns) / nd."""
        return max(t + ns * self._dBr, ctx * (nd + ns) / nd * self._dF)
