"""Calibration planner, writer, report and the `simulate calibrate` CLI (no GPU needed)."""

from pathlib import Path

import pytest
import yaml
from kernels_synthetic import FIXTURE, synthetic_doc
from servesim.kernels import calibrate as C
from servesim.simulator.cli import app, main
from servesim.simulator.errors import ServesimError
from typer.testing import CliRunner


def _run_main(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_fixture_is_marked_synthetic_and_valid():
    doc = C.read_calibration(FIXTURE)
    assert doc["synthetic"] is True and "SYNTHETIC" in doc["note"]
    assert doc["fingerprint"]["device_name"].startswith("SYNTHETIC")


def test_fixture_matches_its_generator():
    assert C.read_calibration(FIXTURE) == synthetic_doc()


def test_writer_round_trip_and_schema_keys(tmp_path):
    path = C.write_calibration(synthetic_doc(), tmp_path / "sub" / "x.yaml")
    doc = yaml.safe_load(path.read_text())
    assert list(doc)[:6] == ["version", "synthetic", "note", "gpu", "fingerprint", "peaks"]
    for section, keys in C.ROW_KEYS.items():
        assert doc[section], section
        for row in doc[section]:
            assert set(keys) <= set(row)
    g = doc["gemm"][0]
    assert g["flops"] == 2 * g["m"] * g["n"] * g["k"]
    assert g["bytes"] == (g["m"] * g["k"] + g["k"] * g["n"] + g["m"] * g["n"]) * 2
    assert not list(tmp_path.glob("sub/.x.yaml.*"))  # temp file renamed away


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.update(version=3), "version: expected 1 or 2"),
    (lambda d: [d.pop(f) for f in ("memcpy", "gemm", "decode_attention", "prefill_attention",
                                   "allreduce", "moe")], "no rows in any of"),
    (lambda d: d["peaks"].pop("mem_bw_gbps"), "peaks.mem_bw_gbps: expected a number"),
    (lambda d: d["decode_attention"][0].pop("num_heads"),
     "decode_attention[0].num_heads must be a positive number, got None"),
    (lambda d: d["gemm"][1].update(seconds=-1.0), "gemm[1].seconds[0] must be a positive number"),
])
def test_validator_rejects_bad_documents(mutate, msg, tmp_path):
    doc = synthetic_doc()
    mutate(doc)
    with pytest.raises(ServesimError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        C.write_calibration(doc, tmp_path / "bad.yaml")
    assert not (tmp_path / "bad.yaml").exists()


def test_version_1_files_still_validate(tmp_path):
    """Files written before schema version 2 (point rows, triton_s/vendor_s) stay readable;
    their own checks still apply."""
    v1 = Path(__file__).parents[1] / "costmodels" / "fixtures" / "calibration-fixture-a100.yaml"
    doc = C.read_calibration(v1)
    assert doc["version"] == 1
    doc["fingerprint"].pop("torch")
    with pytest.raises(ServesimError, match="fingerprint: missing torch"):
        C.write_calibration(doc, tmp_path / "bad.yaml")


def test_flops_bytes_formulas():
    d = C.DecodeShape(2, 100, 100, 8, 2, 64, "bfloat16", "bfloat16")
    assert C.decode_flops_bytes(d) == (4 * 8 * 64 * 200, 2 * 200 * 2 * 64 * 2 + 2 * 2 * 8 * 64 * 2)
    p = C.PrefillShape(1, 4, 10, 2, 1, 8, "bfloat16")
    flops, nbytes = C.prefill_flops_bytes(p)
    assert flops == 4 * 2 * 8 * (4 * 10 + 4 * 5 // 2)
    assert nbytes == 2 * 14 * 1 * 8 * 2 + 2 * 4 * 2 * 8 * 2
    assert C.gemm_flops_bytes(16, 32, 64, "float8_e4m3fn") == (2 * 16 * 32 * 64,
                                                               16 * 64 + 64 * 32 + 16 * 32 * 2)


def test_report_numbers(capsys):
    result = CliRunner().invoke(app, ["calibrate", "report", str(FIXTURE)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "synthetic" in out.lower()
    lines = out.splitlines()
    row = next(li for li in lines if "bfloat16" in li and "M >= 256" in li)
    assert "median   1.05" in row
    assert "median   1.10" in next(li for li in lines if "M <= 16" in li)
    assert "median  75.00" in next(li for li in lines if "triton  batch>=16" in li)
    assert "median  50.00" in next(li for li in lines if "triton  chunk >= 512" in li)
    assert "90% of 3350.0 GB/s" in out


def test_report_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\ngpu: x\n")
    code, _, err = _run_main(["calibrate", "report", str(bad)], capsys)
    assert code == 2 and err.count("\n") == 1 and "missing top-level key" in err


def test_plan_from_model_catalog():
    models, note = C.load_models()
    plan = C.build_plan("h100-sxm", quick=False)
    ms = {g.m for g in plan.gemm}
    assert ms == set(C.M_FULL)
    if note is None:  # catalog present: every model contributes its qkv at TP 1
        for name, cfg in models.items():
            if not cfg.get("kv_lora_rank"):
                n = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * C._head_dim(cfg)
                assert any(g.n == n and g.k == cfg["hidden_size"] for g in plan.gemm), name
    assert all(g.m <= C.LM_HEAD_MAX_M for g in plan.gemm if g.ops == "lm_head")
    assert any(d.lengths for d in plan.decode)  # mixed-length batches
    assert {p.context for p in plan.prefill} >= {0, 4096}
    quick = C.build_plan("h100-sxm", quick=True)
    assert len(quick.gemm) < len(plan.gemm) and quick.mode == "quick"


def test_plan_falls_back_without_model_files(tmp_path):
    plan = C.build_plan("h100-sxm", quick=True, models_dir=tmp_path)
    assert plan.models == ["llama-3.1-70b", "llama-3.1-8b"]
    assert any("built-in shapes" in n for n in plan.notes)


def test_model_gemms_tp_and_kv_replication():
    cfg = C.FALLBACK_MODELS["llama-3.1-8b"]
    ops = {op: (n, k) for op, n, k in C.model_gemms(cfg, 8)}
    assert ops["qkv"] == ((4 + 2 * 1) * 128, 4096)  # 8 KV heads over 8 ranks: 1 each
    assert ops["o"] == (4096, 512) and ops["down"] == (4096, 14336 // 8)
    assert ops["gate_up"] == (2 * 14336 // 8, 4096) and ops["lm_head"] == (128256 // 8, 4096)
    assert C.model_attention(cfg, 4) == (8, 2, 128)


def test_quick_plan_estimate_under_five_minutes():
    plan = C.build_plan("h100-sxm", quick=True)
    est = C.estimate_plan(plan)
    assert sum(e["total_s"] for e in est.values()) < 300
    full = C.build_plan("h100-sxm", quick=False, fp8=True)
    assert sum(e["total_s"] for e in C.estimate_plan(full).values()) < 600


def test_cli_dry_run_prints_plan(capsys):
    main(["calibrate", "--gpu", "h100-sxm", "--dry-run"])  # returns normally on success
    out = capsys.readouterr().out
    for fam in ("gemm", "decode_attention", "prefill_attention", "memcpy", "total"):
        assert fam in out
    assert "(full)" in out


def test_cli_no_gpu_error(capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = _run_main(["calibrate", "--gpu", "h100-sxm", "--quick"], capsys)
    assert code == 2
    assert err.strip().splitlines() == [f"error: {C.NO_GPU_MESSAGE}"]


def test_cli_requires_gpu_name_and_known_gpu(capsys):
    code, _, err = _run_main(["calibrate", "--dry-run"], capsys)
    assert code == 2 and "--gpu NAME is required" in err
    code, _, err = _run_main(["calibrate", "--gpu", "no-such-gpu", "--dry-run"], capsys)
    assert code == 2 and "no-such-gpu" in err and err.count("\n") == 1


def test_harness_end_to_end_on_cpu(tmp_path, monkeypatch):
    """The measuring loop and row building, on tiny shapes with the interpreter and a wall
    clock (bench.DEVICE = "cpu"): exercises the code a GPU run uses, times are meaningless."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from servesim.kernels import bench as B

    monkeypatch.setattr(B, "DEVICE", "cpu")
    plan = C.Plan(gpu="h100-sxm", mode="quick", peaks=C.FALLBACK_PEAKS["h100-sxm"], models=[])
    plan.memcpy = [2**20]
    plan.gemm = [C.GemmShape(3, 48, 64, "bfloat16", "qkv"), C.GemmShape(80, 40, 32, "float32", "o")]
    plan.decode = [C.DecodeShape(2, 40, 40, 4, 2, 16, "bfloat16", "bfloat16"),
                   C.DecodeShape(2, 25, 40, 4, 1, 16, "float32", "float32", (10, 40))]
    plan.prefill = [C.PrefillShape(1, 20, 10, 4, 2, 16, "float32")]
    plan.moe = [C.MoeShape(3, 16, 32, 2, 4, 2)]
    plan.allreduce = [(2, 1024), (2, 4096)]
    # NCCL needs >= 2 GPUs: the process-spawning runner is replaced, the rows are real code
    monkeypatch.setattr(B, "time_allreduce", lambda tp, sizes, s: [
        (mode, b, t + b * 1e-9) for b in sizes for mode, t in (("eager", 2e-5), ("graph", 5e-6))])
    doc = C.new_document("h100-sxm", synthetic_doc()["fingerprint"], dict(plan.peaks))
    ticks = []
    C.measure_plan(plan, doc, C.BenchSettings(0.0, 0.0, 1, 1),
                   progress=lambda total: lambda: ticks.append(total))
    assert "skipped" not in doc, doc.get("skipped")
    assert len(ticks) == 9
    assert [(r["mode"], r["tp"], r["bytes"]) for r in doc["allreduce"]] == [
        ("eager", 2, 1024), ("graph", 2, 1024), ("eager", 2, 4096), ("graph", 2, 4096)]
    assert [len(doc[k]) for k in ("memcpy", "gemm", "decode_attention", "prefill_attention",
                                  "moe")] == [1, 2, 2, 1, 1]
    assert doc["decode_attention"][1]["vendor_s"] is None  # mixed lengths: no dense vendor path
    assert doc["decode_attention"][1]["kernel"] == "triton"
    g = doc["gemm"][0]
    assert g["vendor_impl"] == "torch.matmul"
    assert g["seconds"] == min(g["triton_s"], g["vendor_s"])  # the faster of the two
    moe = doc["moe"][0]
    assert (moe["tokens"], moe["inter"], moe["tp"], moe["ep"]) == (3, 32, 2, 1)
    assert moe["kernel"].startswith(("torch reference", "vllm"))
    C.write_calibration(doc, tmp_path / "cpu.yaml")  # validates as schema version 2
    from servesim.costmodels.calibration import Calibration

    c = Calibration(tmp_path / "cpu.yaml", C.read_calibration(tmp_path / "cpu.yaml"))
    assert c.allreduce(2, 4096, graph=True) == (5e-6 + 4096e-9, "calibration:measured/cpu.yaml")
    assert c.gemm(3, 48, 64)[0] == g["seconds"]


def test_cost_model_reader_accepts_the_writer_output():
    """Contract with costmodels/calibration.py: every family the writer produces is read back
    at its measured points (the faster of Triton and vendor)."""
    from servesim.costmodels.calibration import Calibration

    doc = C.read_calibration(FIXTURE)
    c = Calibration(FIXTURE, doc)
    row = next(r for r in doc["decode_attention"] if r["batch"] == 16)
    assert c.decode(32, 8, 128, "bfloat16", 16, 4096)[0] == row["triton_s"]
    row = next(r for r in doc["prefill_attention"] if r["chunk"] == 2048)
    assert c.prefill(32, 8, 128, "bfloat16", 2048, 0)[0] == row["vendor_s"] < row["triton_s"]
    assert c.allreduce(2, 2**16, graph=True)[0] == pytest.approx(5e-6 + 2**16 / 360e9)
    assert c.allreduce(2, 2**16, graph=False)[0] == pytest.approx(20e-6 + 2**16 / 360e9)
    row = doc["moe"][1]
    assert c.moe("bfloat16", 4096, 14336, 2, 8, 2, 64)[0] == row["seconds"]


def test_moe_reference_matches_a_dense_computation():
    """bench._torch_moe against the definition: Σ_j w_j · W2_e(silu(W1_e x) · W3_e x)."""
    torch = pytest.importorskip("torch")
    from servesim.kernels import bench as B

    g = torch.Generator().manual_seed(0)
    T, h, i, E, k = 5, 8, 6, 4, 2
    x = torch.randn(T, h, generator=g)
    w13 = torch.randn(E, 2 * i, h, generator=g)
    w2 = torch.randn(E, h, i, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 2], [1, 3]])
    wts = torch.rand(T, k, generator=g)
    want = torch.zeros(T, h)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            a = w13[e] @ x[t]
            want[t] += wts[t, j] * (w2[e] @ (torch.nn.functional.silu(a[:i]) * a[i:]))
    assert torch.allclose(B._torch_moe(x, w13, w2, ids, wts), want, atol=1e-4)


def test_plan_has_moe_and_allreduce_rows():
    plan = C.build_plan("h100-sxm", quick=False, num_gpus=4)
    mixtral = {(m.tp, m.tokens) for m in plan.moe if m.experts == 8 and m.hidden == 4096}
    assert mixtral == {(tp, t) for tp in (1, 2, 4, 8) for t in C.MOE_TOKENS}
    assert {tp for tp, _ in plan.allreduce} == {2, 4}
    assert {b for _, b in plan.allreduce} == {2**k for k in range(10, 29, 2)}
    one = C.build_plan("h100-sxm", quick=True)
    assert one.allreduce == [] and any("needs >= 2 GPUs" in n for n in one.notes)
    est = C.estimate_plan(plan)
    assert est["moe"]["shapes"] == len(plan.moe) and est["allreduce"]["shapes"] == 20


class _FakeGpu:
    """The bench functions on a fake clock: each timed shape takes 10 s of it; gemm number
    ``interrupt_at`` (1-based) raises KeyboardInterrupt, as Ctrl-C / SIGTERM would."""

    def __init__(self, monkeypatch, interrupt_at=None):
        from servesim.kernels import bench as B

        self.now, self.gemms = 1000.0, 0
        self.interrupt_at = interrupt_at
        monkeypatch.setattr(C.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(B, "time_memcpy", lambda n, s: self._tick(2e-4))
        monkeypatch.setattr(B, "time_gemm", self._gemm)
        monkeypatch.setattr(B, "time_decode", lambda d, bs, s: self._tick(
            {"triton_s": 3e-5, "vendor_s": None, "vendor_impl": None, "num_splits": 1}))

    def _tick(self, r):
        self.now += 10.0
        return r

    def _gemm(self, m, n, k, dtype, s):
        self.gemms += 1
        if self.gemms == self.interrupt_at:
            raise KeyboardInterrupt
        return self._tick({"triton_s": 2e-5, "vendor_s": 1e-5, "vendor_impl": "torch.matmul"})


def _small_plan():
    plan = C.Plan(gpu="h100-sxm", mode="quick", peaks=C.FALLBACK_PEAKS["h100-sxm"], models=[])
    plan.memcpy = [2**20]
    plan.gemm = [C.GemmShape(m, 4096, 4096, "bfloat16", "qkv") for m in (1, 16, 256)]
    plan.decode = [C.DecodeShape(b, 1024, 1024, 32, 8, 128, "bfloat16", "bfloat16")
                   for b in (1, 8)]
    return plan


def _measure_until(limit_s: float) -> dict:
    """measure_plan of :func:`_small_plan` on the fake clock with a ``limit_s`` deadline."""
    plan = _small_plan()
    doc = C.new_document("h100-sxm", synthetic_doc()["fingerprint"], dict(plan.peaks))
    with pytest.MonkeyPatch.context() as mp:
        fake = _FakeGpu(mp)
        C.measure_plan(plan, doc, C.BENCH_QUICK, deadline=fake.now + limit_s)
    return doc


def test_time_limit_keeps_the_rows_measured_before_it():
    """No shape starts after the deadline: at 10 s per shape and a 25 s limit, the memcpy and
    two GEMMs (started at 0, 10, 20 s) are kept; the third GEMM (at 30 s) is not started."""
    doc = _measure_until(25)
    assert [len(doc[f]) for f in ("memcpy", "gemm", "decode_attention")] == [1, 2, 0]
    assert [r["m"] for r in doc["gemm"]] == [1, 16]
    assert doc["source"]["partial"] == "time limit reached after 3 of 6 shapes"
    doc = _measure_until(1e6)
    assert "partial" not in doc["source"]
    assert [len(doc[f]) for f in ("memcpy", "gemm", "decode_attention")] == [1, 3, 2]


def _calibrate_here(monkeypatch, plan):
    """run_calibration without a GPU: the plan, fingerprint and GPU check replaced."""
    pytest.importorskip("torch")
    monkeypatch.setattr(C, "require_gpu", lambda: None)
    monkeypatch.setattr(C, "build_plan", lambda gpu, quick, **kw: plan)
    monkeypatch.setattr(C, "fingerprint", lambda mode: dict(
        synthetic_doc()["fingerprint"], date=C.utc_now()))


def test_interrupt_writes_the_rows_measured_so_far(tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM during the second GEMM: the memcpy and first GEMM rows are written,
    marked partial, and the run ends with Interrupted (exit 130) naming the file."""
    from servesim.simulator.errors import Interrupted

    _calibrate_here(monkeypatch, _small_plan())
    _FakeGpu(monkeypatch, interrupt_at=2)
    out = tmp_path / "h100.yaml"
    out.write_text("an earlier, complete file")
    with pytest.raises(Interrupted) as e:
        C.run_calibration("h100-sxm", out, quick=True, log=lambda *_: None)
    part = tmp_path / "h100.partial.yaml"
    assert str(e.value) == f"stopped by Ctrl-C/SIGTERM after 2 of 6 shapes; written to {part}"
    assert e.value.exit_code == 130
    assert out.read_text() == "an earlier, complete file"  # not replaced by a partial one
    doc = C.read_calibration(part)
    assert [len(doc[f]) for f in ("memcpy", "gemm", "decode_attention")] == [1, 1, 0]
    assert doc["source"]["partial"] == "stopped by Ctrl-C/SIGTERM after 2 of 6 shapes"
    # interrupted during the first GEMM (only the memcpy probe measured): nothing is written
    out2 = tmp_path / "none.yaml"
    _calibrate_here(monkeypatch, _small_plan())
    _FakeGpu(monkeypatch, interrupt_at=1)
    with pytest.raises(Interrupted, match="no kernel was measured; nothing was written"):
        C.run_calibration("h100-sxm", out2, quick=True, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h100.partial.yaml", "h100.yaml"]
    # the time limit reached after the memcpy probe alone: an error, nothing written
    _FakeGpu(monkeypatch)
    with pytest.raises(ServesimError, match="before any GEMM, attention or MoE kernel"):
        C.run_calibration("h100-sxm", out2, quick=True, log=lambda *_: None, time_limit=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h100.partial.yaml", "h100.yaml"]


def test_cli_time_limit_and_the_partial_file_warning(tmp_path, monkeypatch, capsys):
    """--time-limit reaches the run; the cost model warns (one line) when it reads a partial
    file, whose measured families replace the shipped ones."""
    import warnings

    from servesim.costmodels import build_cost_model
    from servesim.costmodels.calibration import CalibrationWarning
    from servesim.simulator.config import load_config, resolve_config

    _calibrate_here(monkeypatch, _small_plan())
    _FakeGpu(monkeypatch)
    out = tmp_path / "h100.yaml"
    main(["calibrate", "--gpu", "h100-sxm", "--quick", "--quiet", "--time-limit", "15",
          "-o", str(out)])
    io = capsys.readouterr()
    out = tmp_path / "h100.partial.yaml"
    assert io.out.strip() == f"wrote {out}"
    assert io.err.strip() == ("partial: time limit reached after 2 of 6 shapes; point "
                              "hardware.calibration at the file to use it")
    doc = C.read_calibration(out)
    assert doc["source"]["partial"] == "time limit reached after 2 of 6 shapes"
    cfg = resolve_config(load_config(None, ["model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                                            f"hardware.calibration={out}"]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        build_cost_model(cfg)
    msgs = [str(x.message) for x in w if issubclass(x.category, CalibrationWarning)]
    assert msgs == [(f"{out}: a partial calibration (time limit reached after 2 of 6 shapes); "
                     "each op family it has replaces the shipped one (but attention or MoE "
                     "measured only on stand-ins for vLLM's kernels): re-run `simulate "
                     "calibrate` to complete it")]


def test_calibrate_says_which_families_auto_takes_from_the_shipped_file(tmp_path):
    """The H100 run committed under configs/calibration/measured (no vLLM on that machine):
    attention (SDPA / Triton) and MoE (torch reference) yield to the shipped FA3 / fused-MoE
    tables under ``auto``, GEMMs (cuBLAS) do not; attention timed on vLLM's kernel does not
    yield; a GPU with no shipped file has nothing to yield to."""
    import json

    src = Path(C.__file__).resolve().parents[1] / "configs" / "calibration" / "measured"
    lines = C.yielded_families(src / "h100-sxm.json", "h100-sxm")
    assert [x.split()[1] for x in lines] == ["decode_attention", "prefill_attention", "moe"]
    assert lines[1] == (
        "note: prefill_attention was timed on stand-ins for vLLM's kernels (sdpa(contiguous "
        "kv, causal lower-right), sdpa(contiguous kv, causal lower-right, enable_gqa); no "
        "vLLM kernel here): under hardware.calibration: auto the shipped h100-sxm.json "
        "(vllm_flash_attn_fa3) keeps it")
    doc = json.loads((src / "h100-sxm.json").read_text())
    for fam in ("decode_attention", "prefill_attention"):
        for r in doc[fam]:
            r["kernel"] = "vllm flash_attn_varlen_func (FA3, paged)"
    doc["moe"][0]["vllm_error"] = "moe: ImportError: fused_experts"
    (tmp_path / "h100-sxm.json").write_text(json.dumps(doc))
    lines = C.yielded_families(tmp_path / "h100-sxm.json", "h100-sxm")
    assert len(lines) == 1 and lines[0].startswith(
        "note: moe was timed on stand-ins for vLLM's kernels (torch reference (per-expert "
        "GEMMs); vLLM's kernel failed its check, see vllm_error)")
    assert C.yielded_families(src / "h100-sxm.json", "a10g") == []
