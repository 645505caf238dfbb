"""Multi-LoRA as vLLM 0.22.1 schedules and loads adapters: ``max_loras`` per step with
``skipped_waiting`` (``Scheduler.schedule``), the worker's GPU/CPU adapter LRU caches
(``LRUCacheWorkerLoRAManager.add_adapter``, ``LRUCacheLoRAModelManager.activate_adapter``),
load times, punica kernel cost and slot memory (``costmodels/lora.py``)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from servesim.costmodels import BatchShape, build_cost_model, plan_memory
from servesim.costmodels.lora import LoadTimes, adapter_bytes, load_seconds
from servesim.costmodels.specs import load_model_spec
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.errors import ConfigError
from servesim.simulator.lora import AdapterAssignment, LoRAConfig, LoRAScheduling
from servesim.simulator.runner import run_experiment
from servesim.workloads.schema import RequestSpec

from tests.simulator.harness import Harness

LOADS = LoadTimes(h2d_s=0.001, disk_s=0.030, adapter_bytes=1)


def lora_harness(max_loras=2, max_cpu_loras=None, policy="fcfs", **kw):
    h = Harness(policy=policy, **kw)
    lc = LoRAConfig(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    h.sched.enable_lora(LoRAScheduling(lc, LOADS))
    return h


def add(h, rid, prompt, max_tokens, lora):
    r = h.make(rid, prompt, max_tokens)
    r.spec.lora = lora
    h.sched.add_request(r)
    return r


def adapters(out) -> set:
    return {r.spec.lora for r, _, _ in out.scheduled if r.spec.lora}


def test_max_loras_two_runs_at_most_two_adapters_and_the_third_when_a_slot_frees():
    """vLLM: a waiting request whose adapter would exceed max_loras among the scheduled
    requests is skipped (skipped_waiting), not blocking later requests; skipped requests are
    looked at first next step."""
    h = lora_harness(max_loras=2)
    add(h, "a1", 32, 3, "a")
    add(h, "b1", 32, 10, "b")
    add(h, "c1", 32, 5, "c")
    add(h, "a2", 32, 3, "a")  # behind c1, same adapter as a1: admitted (no head-of-line block)
    add(h, "d1", 32, 5, "d")
    steps = []
    while h.sched.has_unfinished_requests():
        out = h.step()
        steps.append(out)
        assert len(adapters(out)) <= 2
        assert out.shape.num_loras == len(adapters(out))
    first = steps[0].as_dict()
    assert set(first) == {"a1", "b1", "a2"}
    assert h.sched.num_waiting == 0
    # a1, a2 finish after their 3rd output (step 3); step 4 has b1 alone -> c1 joins first
    # (skipped_waiting ahead of waiting, in skip order), d1 is skipped again
    assert all("c1" not in s.as_dict() and "d1" not in s.as_dict() for s in steps[:3])
    assert set(steps[3].as_dict()) == {"b1", "c1"}
    assert h.reqs["c1"].first_scheduled_time == pytest.approx(3.0)  # step 4 runs 3 → 4
    # c1 (5 outputs from step 4) finishes at step 8, before b1 (step 10): d1 joins at step 9
    assert h.reqs["c1"].finish_time == pytest.approx(8.0)
    d1_first = next(i for i, s in enumerate(steps) if "d1" in s.as_dict())
    assert d1_first == 8 and set(steps[8].as_dict()) == {"b1", "d1"}
    assert all(r.num_output_tokens == r.max_tokens for r in h.finished)


def test_skipped_requests_count_as_waiting_and_keep_fcfs_order():
    h = lora_harness(max_loras=1)
    add(h, "x", 16, 4, "x")
    for i in range(3):
        add(h, f"y{i}", 16, 2, "y")
    out = h.step()
    assert set(out.as_dict()) == {"x"}
    assert h.sched.num_waiting == 3  # waiting + skipped_waiting, as vLLM's request counts
    order = []
    while h.sched.has_unfinished_requests():
        for rid in h.step().as_dict():
            if rid not in order and rid != "x":
                order.append(rid)
    assert order == ["y0", "y1", "y2"]


def test_priority_policy_compares_waiting_and_skipped_heads():
    h = lora_harness(max_loras=1, policy="priority")
    add(h, "x", 16, 3, "x")
    r = add(h, "y", 16, 2, "y")
    r.priority = 0
    h.step()
    assert set(h.step().as_dict()) == {"x"}
    while h.sched.has_unfinished_requests():
        h.step()
    assert h.reqs["y"].num_output_tokens == 2


def test_gpu_evicted_adapter_in_cpu_pays_h2d_one_not_in_cpu_pays_disk():
    """LRUCacheWorkerLoRAManager.add_adapter: missing from the CPU cache → load from disk
    (evicting the CPU's LRU adapter, which leaves the GPU too), then activate_adapter:
    missing from the GPU slots → evict the GPU's LRU and copy it in."""
    lc = LoRAConfig(enable_lora=True, max_loras=1, max_cpu_loras=2)
    st = LoRAScheduling(lc, LOADS)

    def batch(name):
        h = Harness()
        r = h.make("r", 8, 1)
        r.spec.lora = name

        out = SimpleNamespace(scheduled=[(r, 8, 0)], shape=BatchShape(0, 0, 0, (8,), (0,), 1))
        st.on_batch(out)
        return out.shape.lora_h2d_s, out.shape.lora_disk_s

    assert batch("a") == (0.001, 0.030)  # cold: disk + copy
    assert batch("a") == (0.0, 0.0)  # in a GPU slot
    assert batch("b") == (0.001, 0.030)  # a leaves the GPU slot, stays in CPU memory
    assert batch("a") == (0.001, 0.0)  # evicted from GPU, held in CPU: the copy only
    assert batch("c") == (0.001, 0.030)  # CPU holds {b, a}: b (LRU) is dropped
    assert batch("b") == (0.001, 0.030)  # not in CPU any more: disk again
    assert st.counters()["lora_loads_from_disk"] == 4
    assert st.counters()["lora_loads_from_cpu"] == 5
    assert list(st.cpu) == ["c", "b"] and list(st.gpu) == ["b"]


def test_load_times_from_adapter_size_and_links():
    """Adapter bytes = Σ layers · rank · (in + out) · 2; CPU→GPU at PCIe bandwidth (+ one copy
    per module and layer), disk at disk_load_gbps + latency; the step pays them."""
    spec = load_model_spec(load_config(None).model)
    b16 = adapter_bytes(spec, 16)
    assert b16 == 32 * 16 * ((4096 + 6144) + (4096 + 4096) + (4096 + 28672) + (14336 + 4096)) * 2
    assert adapter_bytes(spec, 64) == 4 * b16
    cfg = resolve_config(load_config(None, ["hardware.name=h100-sxm", "lora.enable_lora=true"]))
    lt = load_seconds(cfg, spec, build_cost_model(cfg).hw)
    assert lt.disk_s == pytest.approx(b16 / 1e9 + 0.005)
    assert b16 / 64e9 < lt.h2d_s < lt.disk_s
    m = build_cost_model(cfg)
    shape = BatchShape(8, 8000, 1000, num_sampled=8, num_loras=2, lora_tokens=8)
    t = m.step_seconds(shape)
    shape.lora_h2d_s = lt.h2d_s
    assert m.step_seconds(shape) == pytest.approx(t + lt.h2d_s)
    names = [op.name for op in m.step_time(shape).breakdown]
    assert "lora_shrink_expand" in names and "lora_load_h2d" in names


def test_lora_kernels_cost_grows_with_adapters_and_tokens():
    cfg = resolve_config(load_config(None, ["hardware.name=h100-sxm", "lora.enable_lora=true",
                                            "lora.max_loras=8"]))
    m = build_cost_model(cfg)
    base = m.step_seconds(BatchShape(64, 64000, 1000, num_sampled=64))
    one = m.step_seconds(BatchShape(64, 64000, 1000, num_sampled=64, num_loras=1,
                                    lora_tokens=64))
    eight = m.step_seconds(BatchShape(64, 64000, 1000, num_sampled=64, num_loras=8,
                                      lora_tokens=64))
    assert base < one < eight
    assert (one - base) / base < 0.2  # decode: a small overhead, as the course measures


def test_slots_come_out_of_the_kv_cache():
    base = plan_memory(resolve_config(load_config(None, ["hardware.name=h100-sxm"])))
    lp = plan_memory(resolve_config(load_config(None, [
        "hardware.name=h100-sxm", "lora.enable_lora=true", "lora.max_loras=8",
        "lora.max_lora_rank=64"])))
    spec = load_model_spec(load_config(None).model)
    assert lp.lora_bytes == 8 * adapter_bytes(spec, 64)  # TP 1: slots = full adapters
    assert lp.weights_bytes == base.weights_bytes + lp.lora_bytes
    assert lp.num_gpu_blocks < base.num_gpu_blocks


def test_adapter_popularity_is_seeded_zipf_with_base_fraction():
    lc = LoRAConfig(enable_lora=True, adapters=8, popularity="zipf", zipf_s=1.0,
                    base_fraction=0.25)

    class W:
        meta: dict = {}  # noqa: RUF012

        def __iter__(self):
            for i in range(20000):
                yield RequestSpec(arrival_s=i, prompt_len=10, output_len=10)

    got = [s.lora for s in AdapterAssignment(W(), lc, seed=1)]
    again = [s.lora for s in AdapterAssignment(W(), lc, seed=1)]
    assert got == again
    c = Counter(got)
    assert c[None] / 20000 == pytest.approx(0.25, abs=0.01)
    assert c["lora-0"] / c["lora-1"] == pytest.approx(2.0, rel=0.1)
    assert len([k for k in c if k]) == 8


def test_config_validation_follows_vllm():
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        load_config(None, ["lora.enable_lora=true", "lora.max_loras=4", "lora.max_cpu_loras=2"])
    with pytest.raises(ConfigError, match="max_lora_rank"):
        load_config(None, ["lora.enable_lora=true", "lora.max_lora_rank=12"])
    c = resolve_config(load_config(None, ["lora.enable_lora=true", "lora.max_loras=3"]))
    assert c.lora.max_cpu_loras == 3


def test_lora_run_end_to_end_writes_counters_and_timeseries():
    r = run_experiment(load_config(None, [
        "hardware.name=h100-sxm", "workload.num_prompts=200", "workload.request_rate=20",
        "lora.enable_lora=true", "lora.max_loras=2", "lora.max_cpu_loras=4", "lora.adapters=8"]))
    c = r.counters
    assert c["lora_max_active_adapters"] == 2
    assert c["lora_adapters_seen"] == 8
    assert c["lora_loads_from_disk"] >= 8 and c["lora_loads_from_cpu"] >= c[
        "lora_loads_from_disk"]
    assert max(r.steps["lora_num_active_adapters"]) == 2
    assert (r.requests["finished_reason"] == "length").all()


def test_priority_policy_orders_waiting_and_skipped_requests_by_priority():
    """vLLM with ``--scheduling-policy priority`` and LoRA: both the waiting queue and
    ``skipped_waiting`` are priority queues (lower value first, then arrival). ``x`` holds the
    only adapter slot; ``y3`` (priority 3) is skipped at step 1, ``y1`` (priority 1, sent
    later) at step 2; when the slot frees, ``y1`` runs first, then ``y3``; ``w0`` and ``w2``
    (adapter x, priority 0 and 2, sent in the order w2, w0) join the running x in priority
    order."""
    h = lora_harness(max_loras=1, policy="priority", max_num_seqs=2)
    x = add(h, "x", 16, 4, "x")
    x.priority = 0
    y3 = h.make("y3", 16, 2)
    y3.spec.lora, y3.priority = "y", 3
    h.sched.add_request(y3)
    assert set(h.step().as_dict()) == {"x"}  # y3 skipped (adapter limit)
    y1 = h.make("y1", 16, 2)
    y1.spec.lora, y1.priority = "y", 1
    h.sched.add_request(y1)
    assert set(h.step().as_dict()) == {"x"}  # y1 skipped too
    order = []
    while h.sched.has_unfinished_requests():
        for rid in h.step().as_dict():
            if rid.startswith("y") and rid not in order:
                order.append(rid)
    assert order == ["y1", "y3"]
    h = lora_harness(max_loras=1, policy="priority", max_num_seqs=3)
    for rid, prio in (("x", 1), ("w2", 2), ("w0", 0)):
        r = h.make(rid, 16, 3)
        r.spec.lora, r.priority = "x", prio
        h.sched.add_request(r)
    assert list(h.step().as_dict()) == ["w0", "x", "w2"]


def test_priority_policy_takes_the_better_head_of_waiting_and_skipped():
    """vLLM ``_select_waiting_queue_for_scheduling`` (priority policy): the more urgent of
    the two heads goes first. ``x`` (1 output) holds the only adapter slot in step 1, so
    ``y3`` is skipped; then ``w0`` (priority 0, adapter z) arrives: in step 2 the slot is
    free and ``w0`` beats the skipped ``y3`` (FCFS would take the skipped head first)."""
    h = lora_harness(max_loras=1, policy="priority", max_num_seqs=4)
    for rid, prio, lora, m in (("x", 1, "x", 1), ("y3", 3, "y", 2)):
        r = h.make(rid, 16, m)
        r.spec.lora, r.priority = lora, prio
        h.sched.add_request(r)
    assert set(h.step().as_dict()) == {"x"}
    w = h.make("w0", 16, 2)
    w.spec.lora, w.priority = "z", 0
    h.sched.add_request(w)
    assert set(h.step().as_dict()) == {"w0"}


def test_requests_skipped_in_a_step_that_fills_the_seats_are_not_lost():
    """``max_loras`` 1 and 2 seats: ``y`` (another adapter) is skipped, ``w`` (x's adapter)
    takes the last seat, which ends the waiting loop; ``y`` goes back to skipped_waiting
    (vLLM ``prepend_requests`` after the loop) and runs once x's adapter is gone."""
    h = lora_harness(max_loras=1, max_num_seqs=2)
    add(h, "x", 16, 3, "x")
    add(h, "y", 16, 2, "y")
    add(h, "w", 16, 3, "x")
    add(h, "z", 16, 2, "x")  # still waiting when the seats are full
    assert set(h.step().as_dict()) == {"x", "w"}
    assert h.sched.num_waiting == 2  # y (skipped_waiting) and z
    assert h.sched.waiting.peek_request().request_id == "y"  # skipped ones first (FCFS)
    for _ in range(20):
        if not h.sched.has_unfinished_requests():
            break
        h.step()
    assert {r: q.num_output_tokens for r, q in h.reqs.items()} == {
        "x": 3, "y": 2, "w": 3, "z": 2}
