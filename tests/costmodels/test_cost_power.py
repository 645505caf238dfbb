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
    u1 = d - d * math.exp(-0.2 / tau)
    assert (c.u, c.free, c.extra_seconds) == pytest.approx((u1, dt, dt - 0.2))
    # memory-bound: no charge, the share decays over the step (queued behind: starts at free)
    assert c.step_seconds((0.01, 0.0)) == 0.01
    assert (c.u, c.free) == pytest.approx((u1 * math.exp(-0.01 / tau), dt + 0.01))
    t[0] = dt + 0.01 + 0.05  # 50 ms idle
    u2 = u1 * math.exp(-0.06 / tau)
    got = c.step_seconds((0.002, 0.002))
    mean = 1 + (u2 - 1) * tau / 0.002 * (1 - math.exp(-0.002 / tau))
    assert got == pytest.approx(0.002 * c.factor(mean))
    assert c.u == pytest.approx(1 + (u2 - 1) * math.exp(-0.002 / tau))


def test_cycles_reproduce_the_measured_duty_curve():
    """The duty measurement: 20 ms cycles of compute-bound work at share d, the rest
    memory-bound, for 6 s: the compute-bound part is charged F(d), the measured factor."""
    for d, f in CURVE:
        t = [0.0]
        c = clock(t)
        for _ in range(300):
            x = c.step_seconds((0.02 * d, 0.02 * d))
            if d < 1:
                c.step_seconds((0.02 * (1 - d), 0.0))
        assert x / (0.02 * d) == pytest.approx(f, abs=0.001)


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
    assert got == {2048: 0.938, 4096: 0.946, 8192: 0.966}


def test_engine_charges_it_and_the_fast_path_matches_the_exact_loop():
    """An H100 run: per-request results equal with the quiet-step fast path on and off;
    the counter power_cap_seconds is what the engine was charged (makespan grows by it at
    saturation); without a curve, none and burst times."""
    import servesim.costmodels.power as P
    from servesim.simulator.runner import run_experiment

    cfg = make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                   "workload.num_prompts=120", "workload.request_rate=inf",
                   "workload.input_len=2048", "workload.output_len=32")
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
    back (the share at its steady state: d + (u - d) e^(-dt/tau) converges to d)."""
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
    t = [0.0]
    clk = SustainedClock(m, lambda: t[0])
    clk.u = c / dt  # the steady state
    want = clk.step_seconds(prefill(8192))
    assert js["sustained_step_seconds"] == pytest.approx(want, rel=1e-9)
    assert want / dt == pytest.approx(1.141, abs=0.001)
    text = est("h100-sxm")
    assert "back to back: 232.1" in text and "+14.1%" in text
    assert json.loads(est("a100-sxm4-80gb", "--json"))["sustained_step_seconds"] is None
