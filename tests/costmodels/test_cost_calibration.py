"""Calibration reader: provenance, interpolation, staleness and missing-file warnings.

The file under fixtures/ is a synthetic TEST FIXTURE (times = roofline / made-up efficiency),
not a measurement.
"""

from __future__ import annotations

import datetime as dt
import shutil

import pytest
import yaml
from cmutil import FIXTURES, decode, make_cfg, prefill
from servesim.costmodels import build_cost_model, load_calibration, load_hardware_spec
from servesim.costmodels import calibration as calmod
from servesim.costmodels.calibration import Calibration, CalibrationWarning
from servesim.costmodels.config import HardwareConfig
from servesim.simulator.errors import ConfigError

FIX = FIXTURES / "calibration-fixture-a100.yaml"
L8B = ("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb")


def test_fixture_changes_provenance_from_default_to_calibrated():
    plain = build_cost_model(make_cfg(*L8B, "hardware.calibration=none"))
    cal = build_cost_model(make_cfg(*L8B, f"hardware.calibration={FIX}"))
    b = decode(8, 1024)
    p_ops = {o.name: o for o in plain.step_time(b).breakdown}
    c_ops = {o.name: o for o in cal.step_time(b).breakdown}
    label = "calibrated:calibration-fixture-a100.yaml"
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attn", "lm_head",
                 "input_layernorm", "sampler"):
        assert p_ops[name].provenance == "default"
        assert c_ops[name].provenance == label, name
    assert c_ops["host"].provenance == "default"  # the fixture has no host section
    assert cal.step_seconds(b) != plain.step_seconds(b)
    assert cal.step_seconds(b) == cal.step_time(b).seconds
    pre = prefill(1000, 2000)
    assert cal.step_seconds(pre) == cal.step_time(pre).seconds


def test_efficiency_interpolation():
    spec = load_hardware_spec(HardwareConfig(name="a100-sxm4-80gb"))
    c = Calibration(FIX, yaml.safe_load(FIX.read_text()), spec)
    # fixture: triton_s = roofline / eff is the faster of triton_s and vendor_s
    e1 = c.gemm_eff(1, 6144, 4096)
    e16 = c.gemm_eff(16, 6144, 4096)
    assert e1 == pytest.approx(0.62, rel=0.01)
    assert e16 == pytest.approx(0.60, rel=0.01)
    assert e16 <= c.gemm_eff(4, 6144, 4096) <= e1  # between, in log m
    assert c.gemm_eff(100000, 6144, 4096) == pytest.approx(0.68, rel=0.01)  # clamped
    assert c.gemm_eff(1, 6000, 4000) == e1  # nearest (n, k)
    assert c.decode_eff(1, 512) == pytest.approx(0.35, rel=0.01)
    assert c.decode_eff(64, 4096) == pytest.approx(0.55, rel=0.01)
    mid = c.decode_eff(8, 1500)
    assert 0.35 < mid < 0.55
    assert c.prefill_eff(512, 0) == pytest.approx(0.40, rel=0.01)
    assert c.memcpy_eff == pytest.approx(0.85, rel=0.01)


def test_stale_fingerprint_warns(tmp_path):
    data = yaml.safe_load(FIX.read_text())
    old = dt.datetime.now(dt.UTC) - dt.timedelta(days=400)
    data["fingerprint"]["date"] = old.isoformat()
    p = tmp_path / "old.yaml"
    p.write_text(yaml.safe_dump(data))
    spec = load_hardware_spec(HardwareConfig(name="a100-sxm4-80gb"))
    with pytest.warns(CalibrationWarning, match=r"days old \(> 180\)"):
        load_calibration(HardwareConfig(name="a100-sxm4-80gb", calibration=str(p)), spec)
    c = Calibration(FIX, yaml.safe_load(FIX.read_text()), spec)
    assert c.age_days(dt.datetime(2026, 11, 11, tzinfo=dt.UTC)) == pytest.approx(10)


def test_missing_file_warns_and_falls_back(monkeypatch):
    calmod._warned.clear()
    spec = load_hardware_spec(HardwareConfig(name="l40s"))
    with pytest.warns(CalibrationWarning, match="no calibration file configs/calibration/l40s"):
        assert load_calibration(HardwareConfig(name="l40s"), spec) is None
    assert load_calibration(HardwareConfig(name="l40s", calibration="none"), spec) is None
    with pytest.raises(ConfigError, match="hardware.calibration: no such calibration file"):
        load_calibration(HardwareConfig(name="l40s", calibration="/nope.yaml"), spec)


def test_auto_picks_configs_calibration(tmp_path, monkeypatch):
    """``calibration: auto`` reads configs/calibration/<hardware name>.yaml."""
    cdir = tmp_path / "configs"
    (cdir / "calibration").mkdir(parents=True)
    shutil.copy(FIX, cdir / "calibration" / "a100-sxm4-80gb.yaml")
    monkeypatch.setattr(calmod, "configs_dir", lambda: cdir)
    spec = load_hardware_spec(HardwareConfig(name="a100-sxm4-80gb"))
    c = load_calibration(HardwareConfig(name="a100-sxm4-80gb"), spec)
    assert c is not None and c.label == "calibrated:a100-sxm4-80gb.yaml"


def test_malformed_rows_name_the_place(tmp_path):
    data = yaml.safe_load(FIX.read_text())
    data["gemm"][2]["m"] = "big"
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    spec = load_hardware_spec(HardwareConfig(name="a100-sxm4-80gb"))
    with pytest.raises(ConfigError, match=r"bad.yaml: gemm\[2\]\.m must be a positive number"):
        load_calibration(HardwareConfig(name="a100-sxm4-80gb", calibration=str(p)), spec)


def test_host_section_is_read(tmp_path):
    data = yaml.safe_load(FIX.read_text())
    data["host"] = {"per_step_s": 300e-6, "per_request_s": 6e-6}
    p = tmp_path / "host.yaml"
    p.write_text(yaml.safe_dump(data))
    m = build_cost_model(make_cfg(*L8B, f"hardware.calibration={p}"))
    assert m.host.per_step_s == 300e-6 and m.host.per_request_s == 6e-6
    ops = {o.name: o for o in m.step_time(decode(1, 100)).breakdown}
    assert ops["host"].provenance == "calibrated:host.yaml"
