"""The power cap under sustained compute (costmodels/power.py): the measured curve, the
compute-share average, the slowdown a step is charged, and its use by the engine.

Expected values are recomputed from the module docstring's definitions: share d = c / dt,
u after a step = d + (u0 - d) e^(-dt/tau), the step's mean share
u_bar = d + (u0 - d) (tau/dt) (1 - e^(-dt/tau)), extra = c (F(u_bar) - 1), F the measured
points interpolated from (0, 1)."""

from __future__ import annotations

import json
import math

import pytest
from cmutil import REPO, decode, make_cfg, prefill
from servesim.costmodels import build_cost_model, load_hardware_spec
from servesim.costmodels.config import HardwareConfig
from servesim.costmodels.power import SustainedClock, sustained_clock
from servesim.simulator.errors import ConfigError

H100 = load_hardware_spec(HardwareConfig(name="h100-sxm"))
CURVE = ((0.23, 1.007), (0.38, 1.012), (0.61, 1.066), (0.82, 1.131), (1.0, 1.189))


class Steps:
    """A stand-in cost model whose batches are (step seconds, compute-bound seconds)."""

    def __init__(self, hw=H100):
        self.hw = hw

    @staticmethod
    def step_seconds(b):
        return b[0]

    @staticmethod
    def compute_seconds(b):
        return b[1]


def clock(t: list[float]) -> SustainedClock:
    return SustainedClock(Steps(), lambda: t[0])


def test_the_shipped_curves_are_the_duty_measurements():
    """configs/hardware/{h100-sxm,h200-sxm}.yaml hold gpu_checks_<gpu>.json's duty rows
    (compute share, compute-bound GEMM time / burst time), rounded; other GPUs none."""
    for gpu in ("h100-sxm", "h200-sxm"):
        spec = load_hardware_spec(HardwareConfig(name=gpu))
        duty = json.loads((REPO / "benchmarks" / "data" / f"gpu_checks_{gpu}.json")
                          .read_text())["duty"]
        assert spec.power_cap_curve == tuple(
            (round(r["actual_duty"], 2), round(r["compute_s"] / duty["burst_compute_s"], 3))
            for r in duty["rows"])
        assert spec.power_cap_tau_s == 0.06
    assert H100.power_cap_curve == CURVE
    assert load_hardware_spec(HardwareConfig(name="a100-sxm4-80gb")).power_cap_curve == ()
    assert sustained_clock(build_cost_model(make_cfg("model.name=llama-3.1-8b")), float) is None


def test_factor_interpolates_the_measured_points_from_no_slowdown():
    c = clock([0.0])
    assert c.factor(0.0) == 1.0
    assert c.factor(0.115) == pytest.approx(1.0035)  # halfway to (0.23, 1.007)
    assert c.factor(0.5) == pytest.approx(1.012 + 0.054 * 0.12 / 0.23)
    assert c.factor(0.82) == pytest.approx(1.131)
    assert c.factor(1.3) == 1.189


def test_one_step_from_idle_then_a_memory_bound_step_and_a_gap():
    """A 200 ms step with 180 ms of compute-bound work after idling (u0 = 0), then a 10 ms
    memory-bound step, then 50 ms idle, then a 2 ms compute-bound step."""
    t = [0.0]
    c = clock(t)
    tau, d = 0.06, 0.9
    mean = d + (0 - d) * tau / 0.2 * (1 - math.exp(-0.2 / tau))
    f = 1.131 + (1.189 - 1.131) * (mean - 0.82) / 0.18 if mean > 0.82 else \
        1.066 + (1.131 - 1.066) * (mean - 0.61) / 0.21
    dt = c.step_seconds((0.2, 0.18))
    assert dt == pytest.approx(0.2 + 0.18 * (f - 1))
    # the share it leaves: slowed compute over slowed time, over the slowed step
    d1 = (0.18 + dt - 0.2) / dt
    u1 = d1 - d1 * math.exp(-dt / tau)
    assert (c.u, c.free, c.extra_seconds) == pytest.approx((u1, dt, dt - 0.2))
    # memory-bound: no charge, the share decays over the step (queued behind: starts at free)
    assert c.step_seconds((0.01, 0.0)) == 0.01
    assert (c.u, c.free) == pytest.approx((u1 * math.exp(-0.01 / tau), dt + 0.01))
    t[0] = dt + 0.01 + 0.05  # 50 ms idle
    u2 = u1 * math.exp(-0.06 / tau)
    got = c.step_seconds((0.002, 0.002))
    mean = 1 + (u2 - 1) * tau / 0.002 * (1 - math.exp(-0.002 / tau))
    assert got == pytest.approx(0.002 * c.factor(mean))
    assert c.u == pytest.approx(1 + (u2 - 1) * math.exp(-got / tau))
    c.undo()  # (that step did not run after all)
    assert (c.u, c.free) == pytest.approx((u1 * math.exp(-0.01 / tau), dt + 0.01))
    c.undo()  # (only the last one)
    assert (c.u, c.free) == pytest.approx((u1 * math.exp(-0.01 / tau), dt + 0.01))


def test_pipeline_stages_hold_the_gpu_for_their_share_of_the_latency():
    """pp = 2: a batch's latency passes two stages, each GPU busy for half of it: a 100 ms
    memory-bound batch moves the timeline 50 ms; a compute-bound one is charged the full
    c (F - 1) on its latency, its share taken over its half."""
    t = [0.0]
    steps = Steps()
    steps.pp = 2
    c = SustainedClock(steps, lambda: t[0])
    assert c.step_seconds((0.1, 0.0)) == 0.1 and c.free == pytest.approx(0.05)
    t[0] = 0.05
    tau = 0.06
    mean = 1 + (0 - 1) * tau / 0.05 * (1 - math.exp(-0.05 / tau))
    got = c.step_seconds((0.1, 0.1))
    assert got == pytest.approx(0.1 * c.factor(mean))
    assert c.free == pytest.approx(0.05 + got / 2)
    assert c.extra_seconds == pytest.approx((got - 0.1) / 2)  # (busy time, per GPU)


def test_a_decode_batch_past_the_ridge_is_charged_alike_on_both_paths():
    """On an H100 a decode batch of 512 rows has compute-bound GEMMs (Llama-3.1-8B): the
    quiet-step path (decode_seconds) charges it exactly as step_seconds does."""
    m = build_cost_model(make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                                  "scheduler.max_num_seqs=512"))
    assert m.compute_seconds(decode(512, 1024)) > 0.2 * m.step_seconds(decode(512, 1024))
    times = []
    for path in ("decode", "step"):
        t = [0.0]
        c = SustainedClock(m, lambda t=t: t[0])
        for _ in range(20):
            t[0] += (c.decode_seconds(512, 512 * 1024) if path == "decode"
                     else c.step_seconds(decode(512, 1024)))
        times.append((t[0], c.u, c.extra_seconds))
    assert times[0] == times[1] and times[0][2] > 0


@pytest.mark.parametrize("gpu", ["h100-sxm", "h200-sxm"])
def test_cycles_reproduce_the_measured_duty_curve(gpu):
    """The duty measurement replayed through the clock: 20 ms cycles of the measured calls
    (compute-bound: its calls at their burst time; memory-bound: its calls at their measured
    time) for 3 s: the compute-bound part comes out within 0.5% of the factor measured (the
    curve's shares are the measured, slowed ones, as the clock's)."""
    spec = load_hardware_spec(HardwareConfig(name=gpu))
    duty = json.loads((REPO / "benchmarks" / "data" / f"gpu_checks_{gpu}.json")
                      .read_text())["duty"]
    for r in duty["rows"]:
        t = [0.0]
        c = SustainedClock(Steps(spec), lambda t=t: t[0])
        comp = r["compute_calls"] * duty["burst_compute_s"]
        mem = r["memory_calls"] * (r["memory_s"] or 0.0)
        for _ in range(150):
            x = c.step_seconds((comp, comp))
            if mem:
                c.step_seconds((mem, 0.0))
        assert x / comp == pytest.approx(r["compute_s"] / duty["burst_compute_s"], abs=0.005)


def test_compute_seconds_are_the_compute_bound_ops_of_the_breakdown():
    """``compute_seconds`` = the ops ``simulate estimate`` marks compute-bound (the prefill
    chunk's attention included, decode attention not); a decode step on an H100 has none."""
    m = build_cost_model(make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm"))
    for shape in (prefill(8192), prefill(2048, 4096), prefill(512)):
        ops = m.step_time(shape).breakdown
        want = sum(o.seconds for o in ops if o.bound == "compute")
        # (the attn op also holds reshape_and_cache's fixed 2 us per layer: memory-bound)
        want -= m._attn_fixed if next(o for o in ops if o.name == "attn").bound == \
            "compute" else 0.0
        assert m.compute_seconds(shape) == pytest.approx(want, rel=1e-12)
        assert 0 < want < m.step_seconds(shape)
    assert m.compute_seconds(decode(256, 1024)) == 0.0
    share = m.compute_seconds(prefill(8192)) / m.step_seconds(prefill(8192))
    assert share == pytest.approx(0.901, abs=0.001)


def test_back_to_back_long_prefills_against_the_compiled_step():
    """The compiled decoder's prefills on the H100 (gpu_checks_h100-sxm.json,
    compiled_step; timed back to back after warm-up): burst times 0.83-0.85x of them, with the
    power cap 0.94-0.97x."""
    m = build_cost_model(make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm"))
    rows = json.loads((REPO / "benchmarks" / "data" / "gpu_checks_h100-sxm.json")
                      .read_text())["compiled_step"]
    got = {}
    for r in rows:
        if r["kind"] == "prefill" and r["tokens"] >= 2048:
            t = [0.0]
            c = SustainedClock(m, lambda t=t: t[0])
            for _ in range(8):  # warm-up 3 + 5 timed in the harness
                t[0] += c.step_seconds(prefill(r["tokens"]))
            got[r["tokens"]] = round(c.step_seconds(prefill(r["tokens"])) / r["compiled_s"], 3)
    assert got == {2048: 0.941, 4096: 0.948, 8192: 0.967}


@pytest.mark.parametrize("sets", [
    ("workload.request_rate=inf",),
    ("workload.request_rate=20", "scheduler.async_scheduling=false"),
    ("workload.request_rate=inf", "parallel.pipeline_parallel_size=2")])
def test_engine_charges_it_and_the_fast_path_matches_the_exact_loop(sets):
    """H100 runs (async; synchronous, whose quiet-step loop asks for a step's time and may
    wait for an event first: the clock takes it back; pipeline parallel): per-request results
    equal with the quiet-step fast path on and off; power_cap_seconds is the GPU-busy time it
    added; without a curve, none and burst times."""
    import servesim.costmodels.power as P
    from servesim.simulator.runner import run_experiment

    cfg = make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                   "workload.num_prompts=120", "workload.input_len=2048",
                   "workload.output_len=32", *sets)
    fast = run_experiment(cfg, resolved=True, fast_path=True)
    exact = run_experiment(cfg, resolved=True, fast_path=False)
    for col in ("ttft_s", "e2el_s", "finish_s", "num_preemptions"):
        assert list(fast.requests[col]) == list(exact.requests[col])
    extra = fast.counters["power_cap_seconds"]
    assert extra == exact.counters["power_cap_seconds"] > 0
    orig = P.sustained_clock
    try:  # (run_experiment imports it when it runs)
        P.sustained_clock = lambda cost, now: None
        burst = run_experiment(cfg, resolved=True)
    finally:
        P.sustained_clock = orig
    assert "power_cap_seconds" not in burst.counters
    busy = fast.counters["gpu_busy_seconds"] - burst.counters["gpu_busy_seconds"]
    if "workload.request_rate=inf" in sets:  # (same batches: busy time grows by the charge)
        assert busy == pytest.approx(extra, rel=1e-9)
        assert 0.05 < extra / burst.counters["gpu_busy_seconds"] < 0.15


@pytest.mark.parametrize("curve,msg", [
    ("[[0.5, 1.1], [0.4, 1.2]]", "shares rising"),
    ("[[0.5, 0.9]]", "factors >= 1"),
    ("[[1.5, 1.1]]", "(0, 1]"),
    ("[0.5, 1.1]", "[[compute share, time factor]"),
])
def test_a_bad_curve_is_one_line_naming_the_file(tmp_path, curve, msg):
    src = (REPO / "configs" / "hardware" / "h100-sxm.yaml").read_text()
    src = "\n".join(line for line in src.splitlines() if not line.startswith("power_cap_curve"))
    p = tmp_path / "gpu.yaml"
    p.write_text(src + f"\npower_cap_curve: {curve}\n")
    with pytest.raises(ConfigError) as e:
        load_hardware_spec(HardwareConfig(name=str(p)))
    assert str(e.value).startswith(f"{p}: power_cap_curve must be") and msg in str(e.value)
    assert "\n" not in str(e.value)


def test_estimate_reports_the_back_to_back_step(capsys):
    """``simulate estimate``: the burst step and, on a GPU with a curve, the step run back to
    back (the share at its steady state: the step's own slowed share)."""
    from servesim.simulator.cli import main

    def est(hw, *extra):
        main(["estimate", str(REPO / "configs" / "llama8b_a100.yaml"), "--batch-size", "0",
              "--context", "1", "--prefill-tokens", "8192", "--set", f"hardware.name={hw}",
              *extra])
        return capsys.readouterr().out

    js = json.loads(est("h100-sxm", "--json"))
    m = build_cost_model(make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm"))
    c, dt = m.compute_seconds(prefill(8192)), m.step_seconds(prefill(8192))
    assert js["step_seconds"] == pytest.approx(dt)
    clk = SustainedClock(m, float)
    x = 0.0
    for _ in range(100):  # the steady state: the step's own slowed share
        x = c * (clk.factor((c + x) / (dt + x)) - 1.0)
    assert js["sustained_step_seconds"] == pytest.approx(dt + x, rel=1e-9)
    assert (dt + x) / dt == pytest.approx(1.145, abs=0.001)
    text = est("h100-sxm")
    assert "back to back: 232.861 ms a step, +14.5%" in text
    assert json.loads(est("a100-sxm4-80gb", "--json"))["sustained_step_seconds"] is None


def test_serving_like_steps_on_an_h100_replayed_through_the_clock():
    """gpu_checks_h100-sxm.json, mix: the compiled decoder's 2,048-token prefill followed by
    k = 0 / 1 / 3 / 8 decode steps (64 rows), back to back; replayed with the measured burst
    times and the cost model's compute fractions (prefill 0.87, decode 0), the clock's
    prefill slowdown is within 0.03 of the measured one (1.124 / 1.104 / 1.050 / 1.037x)."""
    d = json.loads((REPO / "benchmarks" / "data" / "gpu_checks_h100-sxm.json")
                   .read_text())["mix"]
    m = build_cost_model(make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm"))
    fp = m.compute_seconds(prefill(2048)) / m.step_seconds(prefill(2048))
    assert fp == pytest.approx(0.873, abs=0.001)
    assert m.compute_seconds(decode(64, 1024)) == 0.0
    bp, bd = d["burst_s"]["prefill"], d["burst_s"]["decode"]
    got, want = [], []
    for r in d["rows"]:
        t = [0.0]
        c = clock(t)
        for _ in range(100):
            x = c.step_seconds((bp, bp * fp))
            t[0] += x
            for _ in range(r["k"]):
                t[0] += c.step_seconds((bd, 0.0))
        got.append(round(x / bp, 3))
        want.append(round(r["prefill_s"] / bp, 3))
    assert want == [1.124, 1.104, 1.05, 1.037]
    assert got == [1.132, 1.093, 1.048, 1.01]
