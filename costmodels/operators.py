"""Per-operator costs of one engine step (vLLM module names, TP-sharded shapes, totals over all
layers): the linear modules (GEMMs, fused MoE experts), elementwise ops, TP/PP collectives,
the LM head and sampler, with their roofline or measured times and provenance; the op
families and their ``scales``. :class:`OperatorCosts` is a base of
:class:`~servesim.costmodels.step.StepCostModel`, whose ``__init__`` sets the attributes it
reads; ``dense_ops`` / ``head_ops`` feed both the memoized hot path and ``step_time``'s
breakdown."""

from __future__ import annotations

from servesim.costmodels.batch import OpCost
from servesim.costmodels.calibration import gemm_roof
from servesim.costmodels.quant import ACT_BYTES
from servesim.costmodels.specs import Linear

DEFAULT = "roofline:default"
SPEC_SHEET = "spec-sheet"

# kernels per invocation (eager launches; also the GPU fixed cost per op)
_K_NORM = 1
_K_GEMM = 1
_K_ROPE = 1
_K_ATTN = 2  # reshape_and_cache + attention
_K_ACT = 1
_K_ROUTER = 2  # gate GEMM + top-k
_K_EXPERTS = 6  # align/permute, w13, act, w2, un-permute, combine
_K_LM_HEAD = 1
_K_SAMPLER = 8  # temperature, softmax/log-softmax, random sampling, gathers


def _roof(flops: float, nbytes: float, peak: float, bw: float, eff_c: float,
          eff_m: float) -> tuple[float, str, float]:
    """(seconds, bound, efficiency) of ``max(flops/(peak·eff_c), bytes/(bw·eff_m))``."""
    tc = flops / (peak * eff_c) if flops else 0.0
    tm = nbytes / (bw * eff_m) if nbytes else 0.0
    return (tc, "compute", eff_c) if tc > tm else (tm, "memory", eff_m)


class OperatorCosts:
    """GEMM, elementwise, collective, MoE and LM-head/sampler ops of ``StepCostModel``."""

    # -- structure helpers --------------------------------------------------------------------

    def _kernels_per_layer(self) -> float:
        s = self.spec
        per_layer = 2 * _K_NORM + _K_ROPE + _K_ATTN
        attn_gemms = [g for g, _, _ in self._gemms if g.op in
                      ("qkv_proj", "o_proj", "qkv_a_proj", "q_b_proj", "kv_b_proj", "q_proj")]
        per_layer += _K_GEMM * len(attn_gemms)
        L = s.num_hidden_layers
        ld, lm = s.num_dense_layers, s.num_moe_layers
        mlp = ld * (2 * _K_GEMM + _K_ACT)
        if lm:
            mlp += lm * (_K_ROUTER + _K_EXPERTS)
            if s.shared_expert_intermediate_size:
                mlp += lm * (2 * _K_GEMM + _K_ACT)
        return per_layer + mlp / L

    def expected_active_experts(self, tokens: int) -> float:
        """Distinct experts hit by ``tokens`` tokens choosing top-k of E uniformly
        (balls into bins): E·(1 − (1 − k/E)^T)."""
        E, k = self.spec.num_experts, self.spec.num_experts_per_tok
        if not E or tokens <= 0:
            return 0.0
        return E * (1.0 - (1.0 - k / E) ** tokens)

    # -- per-token-count ops (memoized by padded token count) ----------------------------------

    def _gemm_op(self, name: str, lin: Linear, n: int, k: int, T: int) -> OpCost:
        """One linear module over its layers: FLOPs 2·T·n·k (·top-k for experts); bytes =
        weights (active experts only) + activations in/out."""
        wf, e, cal = self.weight_format, self.eff, self.calibration
        wb = wf.bytes_per_param if lin.quantized else ACT_BYTES
        if lin.num_experts > 1:
            act_e = self.expected_active_experts(T)
            rows = T * lin.active_experts  # (token, expert) assignments
            flops = 2.0 * rows * n * k
            nbytes = act_e * n * k * wb + rows * (n + k) * ACT_BYTES
            m_eff = rows / act_e if act_e else 0.0
            ec, em = e.grouped_gemm_compute, e.grouped_gemm_memory
            kernels = _K_EXPERTS / 2  # two linears share the fused-MoE kernels
        else:
            rows = T
            flops = 2.0 * T * n * k
            nbytes = n * k * wb + (n if lin.bias else 0) * ACT_BYTES + T * (n + k) * ACT_BYTES
            m_eff = T
            ec, em = e.gemm_compute, e.gemm_memory
            kernels = _K_GEMM if lin.op != "router" else _K_ROUTER
        peak = self.peak_w if lin.quantized else self.peak
        if cal is not None and cal.has("gemm"):
            dtype, wb_, ab_, comp = self._gemm_format(lin)
            roof = max(flops / peak, nbytes / self.bw)
            bound = "compute" if flops / peak > nbytes / self.bw else "memory"
            m = max(m_eff, 1.0)
            t1, prov = cal.gemm(m, n, k, dtype, weight_bytes=wb_, act_bytes=ab_, compute=comp)
            if lin.num_experts > 1:  # grouped GEMM: the measured efficiency at m rows/expert
                eff = min(1.0, gemm_roof(cal.peaks, m, n, k, wb_, ab_, comp) / t1)
                sec = roof / eff
            else:
                sec = t1
                eff = roof / sec if sec > 0 else 1.0
        else:
            sec, bound, eff = _roof(flops, nbytes, peak, self.bw, ec, em)
            sec += kernels * e.kernel_fixed_s
            prov = DEFAULT
        L = lin.layers
        return OpCost(name, L, sec * L, flops * L, nbytes * L, bound, eff, prov)

    def _uva_op(self, T: int) -> OpCost | None:
        """``--cpu-offload-gb``: the wait for the host link. An offloaded layer's linear takes
        max(its own time × its family's scale, its weight bytes / pcie_bw_gbps): this op is
        the excess over the own times, Σ layers × max(0, read − own), unscaled (the link is
        not a kernel). Routed experts: both linears of a layer share the fused-MoE time when
        it is measured."""
        sc = self.scales
        extra = nbytes = 0.0
        moe = []
        measured = self._moe_cache.get(T) if self.spec.num_moe_layers else None
        for lin, n, k in self._gemms:
            f = self._uva.get(lin.name, 0)
            if not f:
                continue
            read = self._uva_read_s(lin, n, k, T)
            nbytes += f * read * self.hw.pcie_bw_gbps * 1e9
            if lin.op == "experts" and measured:
                moe.append((f, read))
                continue
            own = self._gemm_op(lin.op, lin, n, k, T).seconds / lin.layers
            extra += f * max(0.0, read - own * sc.get(self.op_family(lin.op), 1.0))
        if moe:  # (w13 then w2 of a layer: offloaded together, or w13 alone at the boundary)
            t = measured[0] * sc.get("moe", 1.0)
            (f1, r1), (f2, r2) = moe if len(moe) == 2 else (moe[0], (0, 0.0))
            both = min(f1, f2)
            extra += (both * max(0.0, r1 + r2 - t) + (f1 - both) * max(0.0, r1 - t)
                      + (f2 - both) * max(0.0, r2 - t))
        if extra <= 0.0:
            return None
        return OpCost("uva_weight_reads", 1, extra, 0.0, nbytes, "host-link", 1.0, SPEC_SHEET)

    def _uva_read_s(self, lin: Linear, n: int, k: int, T: int) -> float:
        """Seconds to read one layer's weights of ``lin`` (per-rank ``n`` × ``k``; routed
        experts: those ``T`` tokens hit) over the host link: bytes / pcie_bw_gbps."""
        wb = self.weight_format.bytes_per_param if lin.quantized else ACT_BYTES
        per = n * k * wb + (n * ACT_BYTES if lin.bias else 0)
        if lin.num_experts > 1:
            per *= self.expected_active_experts(T)
        return per / (self.hw.pcie_bw_gbps * 1e9)

    def _gemm_format(self, lin: Linear) -> tuple[str, float, float, str]:
        """(GEMM table dtype, weight bytes, activation bytes, tensor rate) of a linear:
        W8A8 fp8 → ``fp8`` (``fp8_block`` with block-scaled checkpoints), int8 → ``int8``,
        bf16/fp16 → ``bfloat16``; weight-only formats (W4A16, fp8 Marlin) keep their name
        (no table: the bf16 table scaled by the rooflines)."""
        if not lin.quantized:
            return "bfloat16", ACT_BYTES, ACT_BYTES, "bf16"
        wf = self.weight_format
        if wf.compute == "fp8":
            return ("fp8_block" if self.spec.weight_block_size else "fp8",
                    wf.bytes_per_param, 1.0, "fp8")
        if wf.compute == "int8":
            return "int8", wf.bytes_per_param, 1.0, "int8"
        if wf.name in ("bf16", "fp16"):
            return "bfloat16", wf.bytes_per_param, ACT_BYTES, "bf16"
        return wf.name, wf.bytes_per_param, ACT_BYTES, "bf16"

    def _elementwise(self, name: str, count: int, nbytes: float, kernels: int) -> OpCost:
        """Memory-bound op: bytes / (bw · eff) + kernels · fixed, totals over ``count`` calls."""
        t = nbytes / (self.bw * self._ew_eff) if nbytes else 0.0
        t += kernels * self.eff.kernel_fixed_s  # memcpy calibration is a 1 GiB copy: no fixed
        return OpCost(name, count, t * count, 0.0, nbytes * count, "memory", self._ew_eff,
                      self._ew_prov)

    def _comm(self, name: str, count: int, payload: float, kind: str = "all_reduce",
              graph: bool = True) -> OpCost:
        """TP all-reduce of ``payload`` bytes per call: the measured all-reduce table of the
        calibration (by bytes and TP size; CUDA-graph or eager per ``graph``) when there is
        one, else from the spec-sheet link bw/latency:

        ring: 2(p−1)·lat + 2(p−1)/p · B / bw; one-shot (vLLM custom all-reduce over a P2P
        fabric, B ≤ 8 MiB): lat + (p−1) · B / bw; two-shot: 2·lat + 2(p−1)/p · B / bw.
        PP handoff: lat + B / bw.
        """
        hw, p = self.hw, self.tp
        cal = self.calibration
        if kind == "all_reduce" and cal is not None and cal.has("allreduce"):
            got = cal.allreduce(p, payload, graph)
            if got is not None:
                t, prov = got
                roof = 2 * (p - 1) / p * payload / hw.link_bw
                return OpCost(name, count, t * count, 0.0, payload * count, "link",
                              roof / t if t > 0 else 1.0, prov)
        lat, bw = hw.link_latency, hw.link_bw
        if kind == "send":
            algos = [(lat, payload / bw)]
        else:
            algos = [(2 * (p - 1) * lat, 2 * (p - 1) / p * payload / bw)]  # NCCL ring
            if hw.has_nvlink and payload <= 8 * 2**20:
                algos.append((lat, (p - 1) * payload / bw))  # one-shot
                algos.append((2 * lat, 2 * (p - 1) / p * payload / bw))  # two-shot
        t_lat, t_bw = min(algos, key=lambda a: a[0] + a[1])
        t = t_lat + t_bw
        bound = "latency" if t_lat >= t_bw else "link"
        return OpCost(name, count, t * count, 0.0, payload * count, bound, 1.0, SPEC_SHEET)

    def dense_ops(self, T: int, graph: bool | None = None) -> list[OpCost]:
        """All ops whose cost depends only on the (padded) token count ``T``, vLLM order;
        ``graph``: whether the step replays a CUDA graph (its all-reduces' latency; default:
        ``T`` within the capture sizes)."""
        h = self.spec.hidden_size
        ops: list[OpCost] = []
        if T <= 0:
            return ops
        if graph is None:
            graph = T <= self._max_graph
        ops.append(self._elementwise("embed_tokens", 1, 2 * T * h * ACT_BYTES, 1))
        ops = self._dense_ops(T, ops, graph)
        if self.scales:
            ops = self._scaled(ops)
        if T <= self.shared_experts_stream_tokens:
            self._overlap_shared_experts(ops)
        return ops

    def _overlap_shared_experts(self, ops: list[OpCost]) -> None:
        """Insert ``shared_experts_overlap`` (negative seconds) after the shared experts: for up
        to ``shared_experts_stream_tokens`` tokens vLLM runs each MoE layer's shared experts on
        an aux CUDA stream, from before the router's gate GEMM until the routed experts finish.
        Concurrency hides latency, not HBM traffic: each stream takes at least its own time
        plus the other's bytes at the HBM spec bandwidth ``bw`` (B/s), so the pair takes
        ``max(t_main + bytes_shared / bw, t_shared + bytes_main / bw)`` s instead of
        ``t_main + t_shared`` (``main``: router + routed experts; ``shared``: the shared
        experts' GEMMs and activation; totals over the MoE layers, identical per layer)."""
        t_main = t_shared = b_main = b_shared = 0.0
        at = 0
        for i, op in enumerate(ops):
            if op.name in ("router", "experts"):
                t_main += op.seconds
                b_main += op.bytes
            elif op.name in ("shared_experts", "shared_experts.act_fn"):
                t_shared += op.seconds
                b_shared += op.bytes
                at = i + 1
        both = max(t_main + b_shared / self.bw, t_shared + b_main / self.bw)
        if at and t_main + t_shared > both:
            ops.insert(at, OpCost("shared_experts_overlap", self.spec.num_moe_layers,
                                  both - (t_main + t_shared), 0.0, 0.0, "overlap", 1.0,
                                  "vllm:shared-experts-stream"))

    def _dense_ops(self, T: int, ops: list[OpCost], graph: bool) -> list[OpCost]:
        s, L, tp = self.spec, self.L, self.tp
        h = s.hidden_size
        # at TP > 1 every norm follows an all-reduce (embedding, o_proj, down_proj / MoE);
        # vLLM's AllReduceFusionPass runs the pair as one FlashInfer kernel up to
        # ``allreduce_rms_fusion_tokens``: the norm's pass over the activations is the
        # all-reduce's, its time taken as the all-reduce's
        fused = T <= self.allreduce_rms_fusion_tokens
        if not fused:
            ops.append(self._elementwise("input_layernorm", 2 * L + 1, 4 * T * h * ACT_BYTES,
                                         _K_NORM))
        merged: dict[str, OpCost] = {}
        for lin, n, k in self._gemms:
            op = self._gemm_op(lin.op, lin, n, k, T)
            if lin.op in merged:
                m = merged[lin.op]
                merged[lin.op] = OpCost(m.name, m.count, m.seconds + op.seconds, m.flops +
                                        op.flops, m.bytes + op.bytes,
                                        m.bound if m.seconds >= op.seconds else op.bound,
                                        m.efficiency, m.provenance)
            else:
                merged[lin.op] = op
        rot = s.rotary_dim or s.head_dim
        kvh = 1 if s.is_mla else s.kv_heads_per_rank(tp)
        rope_bytes = 2 * T * (self.nh_r + kvh) * rot * ACT_BYTES
        order_attn = ("qkv_a_proj", "q_proj", "q_b_proj", "kv_b_proj", "qkv_proj")
        for name in order_attn:
            if name in merged:
                ops.append(merged.pop(name))
        ops.append(self._elementwise("rotary_emb", L, rope_bytes, _K_ROPE))
        if "o_proj" in merged:
            ops.append(merged.pop("o_proj"))
        for name in ("gate_up_proj",):
            if name in merged:
                ops.append(merged.pop(name))
        ld = s.num_dense_layers
        i_r = -(-s.intermediate_size // tp)
        act_calls = ld
        act_bytes = 3 * T * i_r * ACT_BYTES
        if ld:
            ops.append(self._elementwise("act_fn", act_calls, act_bytes, _K_ACT))
        for name in ("down_proj", "router", "experts", "shared_experts"):
            if name in merged:
                ops.append(merged.pop(name))
        if s.num_moe_layers and s.shared_expert_intermediate_size:
            ish = -(-s.shared_expert_intermediate_size // tp)
            ops.append(self._elementwise("shared_experts.act_fn", s.num_moe_layers,
                                         3 * T * ish * ACT_BYTES, _K_ACT))
        ops.extend(merged.values())
        if s.num_moe_layers:
            self._moe_from_table(ops, T)
        if self._uva:
            uva = self._uva_op(T)
            if uva is not None:
                ops.append(uva)
        if tp > 1:
            ops.append(self._comm("all_reduce", 2 * L + 1, T * h * ACT_BYTES, graph=graph))
        if self.pp > 1:
            ops.append(self._comm("pp_send_recv", self.pp - 1, 2 * T * h * ACT_BYTES, "send"))
        return ops

    def _moe_from_table(self, ops: list[OpCost], T: int) -> None:
        """Replace the routed-experts op's time by the measured fused-MoE layer time (per
        layer: tokens ``T``, the model's exact expert shape at this TP), when tabled."""
        cal, s = self.calibration, self.spec
        if cal is None or not cal.has("moe"):
            return
        got = self._moe_cache.get(T, 0)
        if got == 0:
            lin = next(g for g, _, _ in self._gemms if g.op == "experts")
            got = cal.moe(self._gemm_format(lin)[0], s.hidden_size, s.moe_intermediate_size,
                          s.num_experts_per_tok, s.num_experts, self.tp, T)
            self._moe_cache[T] = got
        if got is None:
            return
        t, prov = got
        for i, op in enumerate(ops):
            if op.name == "experts":
                sec = t * op.count
                roof = max(op.flops / self.peak_w, op.bytes / self.bw)
                ops[i] = OpCost(op.name, op.count, sec, op.flops, op.bytes, op.bound,
                                roof / sec if sec > 0 else 1.0, prov)

    def _dense_seconds(self, T: int, graph: bool) -> float:
        """Σ of :meth:`dense_ops`, cached under ``T`` (replayed in a CUDA graph) or ``-T``
        (eager: mode NONE, e.g. a mixed batch under FULL_DECODE_ONLY)."""
        t = comp = 0.0
        for op in self.dense_ops(T, graph):
            t += op.seconds
            if op.bound == "compute":
                comp += op.seconds
        self._dense_cache[T if graph else -T] = t
        self._dense_comp[T if graph else -T] = comp
        return t

    def head_ops(self, s: int) -> list[OpCost]:
        """LM head (vocab-parallel GEMM on the sampled rows, + logits gather at TP>1) and the
        sampler (≈4 fp32 passes over s × vocab logits)."""
        if s <= 0:
            return []
        spec, tp = self.spec, self.tp
        V, h = spec.vocab_size, spec.hidden_size
        v_r = -(-V // tp)
        lin = Linear("lm_head", "lm_head", h, v_r, 1, "replicated", quantized=False)
        op = self._gemm_op("lm_head", lin, v_r, h, s)
        if tp > 1:  # tensor_model_parallel_gather of the logits
            g = self._comm("logits_gather", 1, (tp - 1) * s * v_r * ACT_BYTES, "send")
            op = OpCost(op.name, op.count, op.seconds + g.seconds, op.flops, op.bytes + g.bytes,
                        op.bound, op.efficiency, op.provenance)
        sampler = self._elementwise("sampler", 1, 4 * s * V * 4, _K_SAMPLER)
        return self._scaled([op, sampler]) if self.scales else [op, sampler]

    # -- one global time factor per op family (``scales:`` in a calibration file; simulate fit)

    @staticmethod
    def op_family(name: str) -> str:
        """``gemm`` | ``attention`` | ``elementwise`` | ``comm`` | ``moe`` | ``host_link`` |
        ``overlap`` of an op name."""
        if name == "attn":
            return "attention"
        if name == "experts":
            return "moe"
        if name in ("all_reduce", "pp_send_recv"):
            return "comm"
        if name == "uva_weight_reads":
            return "host_link"
        if name == "shared_experts_overlap":
            return "overlap"
        if name.endswith("_proj") or name in ("lm_head", "router", "shared_experts"):
            return "gemm"
        return "elementwise"

    def set_cpu_offload(self, layers: dict[str, int]) -> None:
        """``--cpu-offload-gb``: ``layers[linear name]`` of each linear's layers keep their
        weights in pinned CPU memory, which the GPU reads over the host link in every forward
        pass (vLLM ``UVAOffloader``, zero-copy): :meth:`_uva_op`."""
        self._uva = dict(layers)
        self._dense_cache.clear()
        self._dense_comp.clear()
        self._decode_step_cache.clear()

    def set_scales(self, scales: dict[str, float]) -> None:
        """Multiply each op family's time by ``scales[family]`` (1 where absent)."""
        self.scales = {k: float(v) for k, v in (scales or {}).items() if float(v) != 1.0}
        self._attn_scale = self.scales.get("attention", 1.0)
        self._dense_cache.clear()
        self._dense_comp.clear()
        self._head_cache.clear()

    def _scaled(self, ops: list[OpCost]) -> list[OpCost]:
        out = []
        for op in ops:
            f = self.scales.get(self.op_family(op.name), 1.0)
            out.append(op if f == 1.0 else OpCost(op.name, op.count, op.seconds * f, op.flops,
                                                  op.bytes, op.bound, op.efficiency / f,
                                                  op.provenance + f"×{f:g}"))
        return out

    def _head_seconds(self, s: int) -> float:
        t = 0.0
        for op in self.head_ops(s):
            t += op.seconds
        self._head_cache[s] = t
        return t
