"""Multi-LoRA serving in the engine, as vLLM 0.22.1 schedules and loads adapters.

Config (``lora:``): vLLM's ``LoRAConfig`` fields (``enable_lora``, ``max_loras``,
``max_lora_rank``, ``max_cpu_loras``, ``target_modules``, ``lora_dtype``,
``fully_sharded_loras``) plus the workload's adapter popularity (``adapters``,
``popularity``, ``zipf_s``, ``base_fraction``, ``adapter_rank``) and the disk the adapters
load from (``disk_load_gbps``, ``disk_load_latency_ms``). Requests carry an adapter name in
``RequestSpec.lora`` (a trace's ``lora`` column); requests without one draw an adapter from
the popularity distribution when ``adapters`` > 0 (seeded; ``base_fraction`` of them use
the base model). The adapter is in the prefix-cache hash (``Request.root_hash``), so
tenants share no KV.

Scheduling (``Scheduler._schedule_waiting`` hooks, vLLM ``Scheduler.schedule``):
``scheduled_loras`` = adapters of the running requests scheduled this step; a waiting
request whose adapter would make it ``max_loras + 1`` is moved to ``skipped_waiting`` and
the loop goes on with the next one (no head-of-line blocking); skipped requests are looked
at first next step (FCFS: ``skipped_waiting or waiting``; PRIORITY: the better head).

Loading (``LRUCacheWorkerLoRAManager`` / ``LRUCacheLoRAModelManager``): for each adapter of
a scheduled batch, in row order — not in the CPU cache (``max_cpu_loras``, LRU): read from
disk, evicting the CPU's least recently used adapter (which leaves the GPU too); else touch
it; then activate it — not in the GPU slots (``max_loras``, LRU): evict the least recently
used active adapter and copy it in; touch it. The load times (``costmodels.lora``) go into
the step (``BatchShape.lora_h2d_s`` / ``lora_disk_s``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

# lora.adapters: the popularity vector holds one float per adapter (8 MB at this bound)
MAX_ADAPTERS = 1_000_000


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoRAConfig(_Section):
    """``lora``: vLLM's LoRAConfig fields + the workload's adapter popularity."""

    enable_lora: bool = False
    max_loras: PositiveInt = Field(1, description="Adapters in one batch (GPU slots)")
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    max_cpu_loras: PositiveInt | None = Field(
        None, description="Adapters kept in CPU memory (LRU); default max_loras")
    target_modules: list[str] | None = Field(
        None, description="Adapted modules (default qkv_proj, o_proj, gate_up_proj, down_proj); "
        "null for the default, not an empty list")
    lora_dtype: Literal["auto", "float16", "bfloat16"] = "auto"
    fully_sharded_loras: bool = False
    # servesim: the workload's adapters and where they load from
    adapters: int = Field(0, ge=0, le=MAX_ADAPTERS, description="Requests without a lora draw "
                          "one of N adapters lora-0..lora-{N-1} (0: only the trace's lora "
                          "column); at most 1,000,000")
    popularity: Literal["uniform", "zipf"] = "zipf"
    zipf_s: float = Field(1.0, ge=0, allow_inf_nan=False, description="Zipf exponent: P(adapter i) ∝ 1/(i+1)^s")
    base_fraction: float = Field(0.0, ge=0, le=1, description="Share of those requests that "
                                 "use the base model")
    adapter_rank: PositiveInt | None = Field(None, description="Rank of the adapters "
                                             "(default max_lora_rank)")
    disk_load_gbps: float = Field(1.0, gt=0, allow_inf_nan=False,
                                  description="Adapter read + parse from disk, GB/s")
    disk_load_latency_ms: float = Field(5.0, ge=0, allow_inf_nan=False,
                                        description="Fixed cost per disk load")

    @field_validator("target_modules")
    @classmethod
    def _modules(cls, v):
        if v is not None and not v:
            raise ValueError("expected at least one module name (null: vLLM's default modules)")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.adapter_rank is not None and self.adapter_rank > self.max_lora_rank:
            raise ValueError(f"adapter_rank ({self.adapter_rank}) is greater than "
                             f"max_lora_rank ({self.max_lora_rank}); vLLM refuses such adapters")
        return self


# ---------------------------------------------------------------------------------------------
# Workload: adapter popularity


class AdapterAssignment:
    """A workload whose requests without an adapter get one drawn from ``lc``'s popularity
    (seeded by ``seed``); ``meta`` passes through."""

    def __init__(self, workload, lc: LoRAConfig, seed: int):
        self.workload, self.lc, self.seed = workload, lc, seed

    @property
    def meta(self) -> dict:
        return self.workload.meta

    def __iter__(self) -> Iterator:
        lc = self.lc
        n = lc.adapters
        if n <= 0:
            yield from self.workload
            return
        rng = np.random.default_rng([int(self.seed), 0x10A])
        if lc.popularity == "uniform":
            p = np.full(n, 1.0 / n)
        else:
            p = 1.0 / np.arange(1, n + 1, dtype=float) ** lc.zipf_s
            p /= p.sum()
        cdf = np.cumsum(p)
        block, j = np.empty(0), 0
        for spec in self.workload:
            if spec.lora is None:
                if j >= len(block):
                    block, j = rng.random(8192 * 2), 0
                base, u = block[j], block[j + 1]
                j += 2
                if base >= lc.base_fraction:
                    spec.lora = f"lora-{min(int(np.searchsorted(cdf, u, side='right')), n - 1)}"
            yield spec


# ---------------------------------------------------------------------------------------------
# Scheduler: skipped_waiting


class SkippedWaitingQueue:
    """vLLM's ``waiting`` + ``skipped_waiting`` pair behind the scheduler's one ``waiting``
    name: ``peek``/``pop`` take from the queue ``_select_waiting_queue_for_scheduling``
    picks, ``skip_head`` moves the peeked request to this step's skipped list, and
    ``end_step`` puts that list in front of ``skipped_waiting`` (``prepend_requests``)."""

    def __init__(self, make_queue, priority: bool):
        self.waiting = make_queue()
        self.skipped = make_queue()
        self.priority = priority
        self._step: list = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.skipped)

    def add_request(self, req) -> None:
        self.waiting.add_request(req)

    def prepend_request(self, req) -> None:
        self.waiting.prepend_request(req)

    def _select(self):
        w, s = self.waiting, self.skipped
        if not self.priority:
            return s if len(s) else w
        if len(w) and len(s):
            a, b = w.peek_request(), s.peek_request()
            return w if (a.priority, a.arrival_time, a.request_id) < (
                b.priority, b.arrival_time, b.request_id) else s
        return w if len(w) else s

    def peek_request(self):
        return self._select().peek_request()

    def pop_request(self):
        return self._select().pop_request()

    def skip_head(self) -> None:
        """The peeked request cannot join this step (``step_skipped_waiting``)."""
        self._step.append(self.pop_request())

    def end_step(self) -> None:
        """``skipped_waiting.prepend_requests(step_skipped_waiting)``: FCFS puts them in
        front, in reverse order of their skipping (``deque.extendleft``); PRIORITY re-adds."""
        if self._step:
            if self.priority:
                for req in self._step:
                    self.skipped.add_request(req)
            else:  # [first skipped, ..., last skipped] ahead of older skipped requests
                for req in reversed(self._step):
                    self.skipped.prepend_request(req)
            self._step = []

    def __contains__(self, req) -> bool:
        return req in self.waiting or req in self.skipped or req in self._step

    def remove(self, req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.skipped:
            self.skipped.remove(req)
        else:
            self._step.remove(req)


# ---------------------------------------------------------------------------------------------
# Scheduler + worker: max_loras per step, adapter caches


class LoRAScheduling:
    """One engine's multi-LoRA state: the ``max_loras`` check of the waiting loop and the
    worker's GPU/CPU adapter LRU caches with their load times."""

    def __init__(self, lc: LoRAConfig, load):
        self.max_loras = lc.max_loras
        self.max_cpu_loras = lc.max_cpu_loras or lc.max_loras
        self.h2d_s, self.disk_s = load.h2d_s, load.disk_s
        self.gpu: OrderedDict[str, None] = OrderedDict()  # _active_adapters (LRU)
        self.cpu: OrderedDict[str, None] = OrderedDict()  # _registered_adapters (LRU)
        self.num_loads_cpu = 0  # CPU → GPU slot copies
        self.num_loads_disk = 0  # disk → CPU reads
        self.num_hits = 0  # adapter already in a GPU slot
        self.adapters_seen: set[str] = set()
        self.max_active = 0

    # -- scheduler ------------------------------------------------------------------------------
    @staticmethod
    def scheduled_loras(out) -> set[str]:
        """vLLM: ``scheduled_loras`` = adapters of the running requests scheduled so far."""
        return {r.spec.lora for r, _, _ in out.scheduled if r.spec.lora is not None}

    def blocked(self, req, scheduled: set[str]) -> bool:
        """Adding ``req`` would exceed ``max_loras`` this step."""
        lora = req.spec.lora
        return (lora is not None and len(scheduled) >= self.max_loras
                and lora not in scheduled)

    # -- worker ---------------------------------------------------------------------------------
    def _add_adapter(self, name: str) -> tuple[float, float]:
        """``LRUCacheWorkerLoRAManager.add_adapter`` + ``activate_adapter``: (h2d, disk) s."""
        cpu, gpu = self.cpu, self.gpu
        disk = h2d = 0.0
        if name not in cpu:
            disk = self.disk_s
            self.num_loads_disk += 1
            if len(cpu) + 1 > self.max_cpu_loras:  # remove_oldest_adapter → deactivate too
                old, _ = cpu.popitem(last=False)
                gpu.pop(old, None)
            cpu[name] = None
        else:
            cpu.move_to_end(name)
        if name not in gpu:
            if len(gpu) >= self.max_loras:
                gpu.popitem(last=False)
            gpu[name] = None
            h2d = self.h2d_s
            self.num_loads_cpu += 1
        else:
            self.num_hits += 1
        gpu.move_to_end(name)
        return h2d, disk

    def on_batch(self, out) -> None:
        """Set the LoRA fields of ``out.shape``: adapters and their tokens, load seconds."""
        shape = out.shape
        names: dict[str, None] = {}
        tokens = 0
        for r, n, _ in out.scheduled:
            lora = r.spec.lora
            if lora is not None:
                names[lora] = None
                tokens += n
        if not names:
            return
        h2d = disk = 0.0
        for name in names:
            a, b = self._add_adapter(name)
            h2d += a
            disk += b
        self.adapters_seen.update(names)
        if len(names) > self.max_active:
            self.max_active = len(names)
        shape.num_loras = len(names)
        # every scheduled token of an adapter row goes through shrink/expand (+ drafts)
        shape.lora_tokens = tokens
        shape.lora_h2d_s = h2d
        shape.lora_disk_s = disk

    def counters(self) -> dict:
        return {"lora_loads_from_cpu": self.num_loads_cpu,
                "lora_loads_from_disk": self.num_loads_disk,
                "lora_slot_hits": self.num_hits,
                "lora_adapters_seen": len(self.adapters_seen),
                "lora_max_active_adapters": self.max_active}
