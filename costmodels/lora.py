"""Multi-LoRA's price, as vLLM 0.22.1 runs it (``vllm/lora/``: punica kernels, worker LRU
caches, stacked slot buffers).

- **Adapter size**: each adapted linear of each layer holds A (rank × in) and B (out × rank);
  an adapter is Σ layers · rank · (in + out) · 2 bytes (``adapter_bytes``). Target modules
  default to the dense decoder linears vLLM supports (``qkv_proj``, ``o_proj``,
  ``gate_up_proj``, ``down_proj``); ``lora.target_modules`` restricts them, as vLLM's
  ``LoRAConfig.target_modules`` does.
- **Slots** (memory): vLLM allocates ``max_loras`` stacked buffers at ``max_lora_rank`` per
  adapted module at model load (``lora_a_stacked`` / ``lora_b_stacked``), so they count with
  the weights and come out of the KV cache (``slot_bytes_per_rank``). Column-parallel layers
  keep A whole and shard B; row-parallel ones shard A and keep B whole
  (``fully_sharded_loras`` shards both).
- **Loads** (``load_seconds``): an adapter missing from the GPU slots is copied from CPU
  memory, one ``set_lora`` copy per module and layer: bytes / PCIe bandwidth + a copy launch
  each; one missing from the CPU cache is first read from disk (bytes / ``disk_load_gbps`` +
  ``disk_load_latency_ms``). The worker does this before the forward
  (``LRUCacheWorkerLoRAManager._apply_adapters``), so copies add GPU-stream time and disk
  reads add host time (hidden behind the GPU only under async scheduling).
- **Kernels** (``LoRACost``): per adapted linear and layer, punica's shrink (x · Aᵀ, in →
  rank) and expand (· Bᵀ, rank → out) over the tokens of adapter rows; the stacked buffers
  are read at ``max_lora_rank`` for each active adapter. Roofline at the default GEMM
  efficiencies (no calibration table covers them), plus a host term for building the
  token → adapter mapping every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from servesim.costmodels.batch import BatchShape, OpCost
from servesim.costmodels.quant import ACT_BYTES
from servesim.costmodels.specs import Linear, ModelSpec

DEFAULT_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# vLLM target-module suffixes that map onto our fused modules
_ALIASES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
            "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def adapted_linears(spec: ModelSpec, target_modules=None) -> list[Linear]:
    """The model's linears an adapter touches (dense decoder modules; routed experts are not
    adapted here)."""
    want = set(DEFAULT_TARGETS)
    if target_modules:
        want = {_ALIASES.get(m, m) for m in target_modules}
    return [lin for lin in spec.linears() if lin.op in want and lin.num_experts == 1]


def adapter_bytes(spec: ModelSpec, rank: int, target_modules=None) -> int:
    """Bytes of one adapter of ``rank`` (full, all layers): Σ layers · rank · (in + out) · 2."""
    return int(sum(lin.layers * rank * (lin.k + lin.n) for lin in
                   adapted_linears(spec, target_modules)) * ACT_BYTES)


def _rank_elems(lin: Linear, tp: int, fully_sharded: bool) -> tuple[int, int]:
    """(A columns, B rows) per rank: the in/out widths of this rank's shrink and expand."""
    n_s, k_s = lin.shard(tp)
    if fully_sharded:
        return k_s, n_s
    if lin.parallel == "row":
        return k_s, lin.n
    return lin.k, n_s


def slot_bytes_per_rank(spec: ModelSpec, max_loras: int, max_lora_rank: int, tp: int,
                        target_modules=None, fully_sharded: bool = False) -> int:
    """GPU bytes of the stacked LoRA buffers on one rank (allocated with the weights)."""
    total = 0
    for lin in adapted_linears(spec, target_modules):
        a, b = _rank_elems(lin, tp, fully_sharded)
        total += lin.layers * max_lora_rank * (a + b)
    return int(max_loras * total * ACT_BYTES)


@dataclass(frozen=True)
class LoadTimes:
    """Seconds to bring one adapter to the GPU: ``h2d_s`` from CPU memory (the slot copy),
    ``disk_s`` from disk into CPU memory (paid before ``h2d_s``)."""

    h2d_s: float
    disk_s: float
    adapter_bytes: int


def load_seconds(cfg, spec: ModelSpec, hw, launch_s: float = 5e-6) -> LoadTimes:
    """One adapter's load times for ``cfg.lora`` on ``hw`` (see module doc)."""
    lc = cfg.lora
    tp = cfg.parallel.tensor_parallel_size
    rank = lc.adapter_rank or lc.max_lora_rank
    lins = adapted_linears(spec, lc.target_modules)
    per_rank = 0
    copies = 0
    for lin in lins:
        a, b = _rank_elems(lin, tp, lc.fully_sharded_loras)
        per_rank += lin.layers * rank * (a + b) * ACT_BYTES
        copies += 2 * lin.layers
    full = adapter_bytes(spec, rank, lc.target_modules)
    h2d = per_rank / (hw.pcie_bw_gbps * 1e9) + copies * launch_s
    disk = full / (lc.disk_load_gbps * 1e9) + lc.disk_load_latency_ms * 1e-3
    return LoadTimes(h2d, disk, full)


class LoRACost:
    """Per-step LoRA terms for :class:`StepCostModel` (``step_extensions``): punica
    shrink/expand over the adapter rows' tokens, this step's adapter copies (GPU stream) and
    disk reads (host), and the host work of the token → adapter mapping."""

    name = "lora"
    host_per_step_s = 20e-6  # punica metadata (set_adapter_mapping) per step, prior
    host_per_token_s = 10e-9  # token_lora_mapping built in Python per scheduled token, prior

    def __init__(self, model, max_lora_rank: int, target_modules=None,
                 fully_sharded: bool = False):
        self.model = model
        e = model.eff
        self._r = max_lora_rank
        self._mods = [_rank_elems(lin, model.tp, fully_sharded) + (lin.layers,)
                      for lin in adapted_linears(model.spec, target_modules)]
        self._kernels = sum(2 * L for _, _, L in self._mods)
        self._fixed = self._kernels * e.kernel_fixed_s
        self._cache: dict[tuple[int, int], tuple[float, float, float]] = {}

    def _kernels_cost(self, T: int, n: int) -> tuple[float, float, float]:
        """(seconds, flops, bytes) of all shrink + expand kernels for ``T`` adapter tokens
        and ``n`` active adapters."""
        key = (T, n)
        got = self._cache.get(key)
        if got is None:
            m, r = self.model, self._r
            e = m.eff
            sec = flops = nbytes = 0.0
            for a, b, L in self._mods:
                f = 2.0 * T * r * (a + b)
                # weights of each active adapter at the padded rank; x read, T×r fp32 buffer
                # written and read back, y read-modify-written
                by = n * r * (a + b) * ACT_BYTES + T * (a + 2 * b) * ACT_BYTES + 2 * T * r * 4
                tc = f / (m.peak * e.gemm_compute)
                tm = by / (m.bw * e.gemm_memory)
                sec += L * max(tc, tm)
                flops += L * f
                nbytes += L * by
            got = self._cache[key] = (sec + self._fixed, flops, nbytes)
        return got

    def __call__(self, batch: BatchShape) -> tuple[float, float]:
        gpu = batch.lora_h2d_s
        if batch.lora_tokens:
            gpu += self._kernels_cost(batch.lora_tokens, batch.num_loras)[0]
        return gpu, (self.host_per_step_s + self.host_per_token_s * batch.num_tokens
                     + batch.lora_disk_s)

    def ops(self, batch: BatchShape) -> list[OpCost]:
        out = []
        if batch.lora_tokens:
            sec, f, by = self._kernels_cost(batch.lora_tokens, batch.num_loras)
            m = self.model
            roof = max(f / m.peak, by / m.bw)
            out.append(OpCost("lora_shrink_expand", self._kernels, sec, f, by,
                              "compute" if f / m.peak > by / m.bw else "memory",
                              roof / sec if sec else 0.0, "roofline:default"))
        if batch.lora_h2d_s:
            out.append(OpCost("lora_load_h2d", 1, batch.lora_h2d_s, 0.0, 0.0, "link", 1.0,
                              "spec-sheet"))
        return out


def attach_lora(model, cfg) -> None:
    """Give ``model`` (a StepCostModel) the LoRA term of ``cfg.lora``."""
    lc = cfg.lora
    ext = LoRACost(model, lc.max_lora_rank, lc.target_modules, lc.fully_sharded_loras)
    model.step_extensions = tuple(model.step_extensions) + (ext,)
