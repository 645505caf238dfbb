"""`simulate calibrate import aiconfigurator` on a small parquet database built here.

The fixture mimics aiconfigurator-core's layout (``systems/data/<system>/<op>/vllm/<ver>/``)
and column names; its numbers are made up (never measurements).
"""

import json
from pathlib import Path

import pytest
import yaml
from servesim.kernels import import_aiconfigurator as A
from servesim.simulator.cli import main

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")  # in the dev extras: CI has it

DEV = "NVIDIA H100 80GB HBM3"
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "llama8b_a100.yaml")


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def _gemm(m, n, k, lat, dtype="bfloat16", kern="torch.nn.functional.linear", ver="0.24.0"):
    return {"framework": "VLLM", "version": ver, "device": DEV, "op_name": "gemm",
            "kernel_source": kern, "gemm_dtype": dtype, "m": m, "n": n, "k": k, "latency": lat}


def _attn(op, b, isl, step, lat, hd=128, kv="bfloat16", window=0, kern="vllm_flash_attn_fa3",
          heads=32, kv_heads=8):
    return {"framework": "VLLM", "version": "0.24.0", "device": DEV, "op_name": op,
            "kernel_source": kern, "batch_size": b, "isl": isl, "num_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": hd, "beam_width": 1,
            "attn_dtype": "bfloat16", "kv_cache_dtype": kv, "step": step,
            "window_size": window, "latency": lat}


@pytest.fixture
def database(tmp_path):
    """``<tmp>/aiconfigurator_core/systems/data`` with a ``-9.9.9.dist-info`` beside it."""
    (tmp_path / "aiconfigurator_core-9.9.9.dist-info").mkdir()
    root = tmp_path / "aiconfigurator_core" / "systems" / "data"
    sysd = root / "h100_sxm"
    gemm = [_gemm(m, n, 4096, 0.01 * (1 + m / 100) * n / 4096)
            for m in (1, 16, 256) for n in (4096, 8192) if (m, n) != (1, 4096)]
    gemm += [_gemm(1, 4096, 4096, 0.010), _gemm(1, 4096, 4096, 0.014)]  # duplicate: median
    gemm += [_gemm(m, 4096, 4096, 0.005, "fp8", "CutlassFP8ScaledMMLinearKernel")
             for m in (1, 16, 256)]
    gemm += [_gemm(1, 4096, 4096, 0.004, "fp8", "TorchScaledMMLinearKernel")]
    gemm += [_gemm(8, 4096, 4096, 0.006, "fp8", "FlashInferScaledMMLinearKernel")]
    gemm += [_gemm(m, 4096, 4096, 0.057, "fp8_block", "DeepGemmFp8BlockScaledMMKernel")
             for m in (1, 16)]  # host-bound lane: not imported
    gemm += [_gemm(1, 4096, 4096, 0.003, "nvfp4", "FlashInferCutlassNvFp4LinearKernel")]
    _write(sysd / "gemm/vllm/0.24.0/gemm_perf.parquet", gemm)
    _write(sysd / "gemm/vllm/0.19.0/gemm_perf.parquet",
           [_gemm(1, 4096, 4096, 0.5, ver="0.19.0")])
    gen = [_attn("generation_attention", b, 1, s, 0.01 + 1e-6 * b * (s + 1))
           for b in (1, 4) for s in (1023, 4095)]
    gen += [_attn("generation_attention", 1, 1, 1023, 0.5, window=1024)]  # windowed: dropped
    gen += [_attn("generation_attention", 1, 1, 1023, 0.5, kern="vllm_flash_attn_fa4")]
    gen += [_attn("generation_attention", 1, 1, s, 0.02, hd=256) for s in (1023, 4095)]
    _write(sysd / "attention/vllm/0.24.0/generation_attention_perf.parquet", gen)
    ctx = [_attn("context_attention", 1, isl, 0, 0.01 + 1e-8 * isl * isl)
           for isl in (16, 1024, 4096)]
    ctx += [_attn("context_attention", 4, 1024, 0, 0.1)]  # batch 4: the model uses batch 1
    _write(sysd / "attention/vllm/0.24.0/context_attention_perf.parquet", ctx)
    ar = [{"framework": "vLLM", "version": "0.24.0", "device": DEV, "op_name": "all_reduce",
           "kernel_source": f"vLLM_custom_{mode}", "allreduce_dtype": "bfloat16",
           "num_gpus": 2, "message_size": size, "latency": lat, "backend": f"vllm_{mode}"}
          for mode, lat in (("graph", 0.004), ("eager", 0.02)) for size in (1024, 1048576)]
    _write(sysd / "comm/vllm/0.24.0/custom_allreduce_perf.parquet", ar)
    moe = [{"framework": "VLLM", "version": "0.24.0", "device": DEV, "op_name": "moe",
            "kernel_source": "vllm_unquantizedfusedmoe_triton_tritonexperts",
            "moe_dtype": "bfloat16", "num_tokens": t, "hidden_size": 4096, "inter_size": 14336,
            "topk": 2, "num_experts": 8, "moe_tp_size": 1, "moe_ep_size": 1,
            "distribution": dist, "latency": lat}
           for t, lat in ((1, 0.2), (64, 0.3)) for dist in ("balanced", "power_law_1.2")]
    moe += [dict(moe[0], kernel_source="vllm_modeloptfp8moe_flashinfer_cutlass", moe_dtype="fp8",
                 latency=0.9)]  # a ModelOpt-checkpoint path: not servesim's fp8
    _write(sysd / "moe/vllm/0.24.0/moe_perf.parquet", moe)
    return root


def _run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def _import(database, out, *extra):
    main(["calibrate", "import", "aiconfigurator", "--gpu", "h100-sxm", "--data-dir",
          str(database), "-o", str(out), *extra])
    return yaml.safe_load(out.read_text())


def _curve(doc, fam, **match):
    rows = [r for r in doc[fam] if all(r.get(k) == v for k, v in match.items())]
    assert len(rows) == 1, (fam, match, rows)
    return rows[0]


def test_import_converts_every_family(database, tmp_path, capsys):
    doc = _import(database, tmp_path / "h100.yaml", "--all-shapes")
    assert "wrote" in capsys.readouterr().out
    assert doc["version"] == 2 and doc["gpu"] == "h100-sxm"
    src = doc["source"]
    assert (src["kind"], src["package_version"], src["license"]) == ("aiconfigurator", "9.9.9",
                                                                     "Apache-2.0")
    assert "measured by NVIDIA" in src["attribution"] and src["device"] == DEV
    for fam in ("gemm", "decode_attention", "prefill_attention", "allreduce", "moe"):
        assert doc["tables"][fam]["source"] == "aiconfigurator-9.9.9/vllm-0.24.0", fam
    # GEMM: ms → s, median of duplicate points, the densest kernel per dtype, no nvfp4
    g = _curve(doc, "gemm", dtype="bfloat16", n=4096, k=4096)
    assert g["m"] == [1, 16, 256]
    assert g["seconds"] == [pytest.approx(1.2e-5), pytest.approx(1.16e-5),
                            pytest.approx(3.56e-5)]
    # fp8: CUTLASS (3 rows) wins over torch (1) at m = 1; FlashInfer fills m = 8
    f8 = _curve(doc, "gemm", dtype="fp8", n=4096, k=4096)
    assert f8["m"] == [1, 8, 16, 256] and f8["seconds"] == [5e-6, 6e-6, 5e-6, 5e-6]
    assert f8["kernel"] == "CutlassFP8ScaledMMLinearKernel+FlashInferScaledMMLinearKernel"
    # block fp8 (host-bound rows) and nvfp4 are not imported
    assert {r["dtype"] for r in doc["gemm"]} == {"bfloat16", "fp8"}
    # decode: context = isl + step; sliding-window rows and the sparser FA4 lane dropped
    d = _curve(doc, "decode_attention", head_dim=128, batch=4)
    assert d["context"] == [1024, 4096] and d["kernel"] == "vllm_flash_attn_fa3"
    assert d["seconds"] == [pytest.approx(1e-5 + 1e-9 * 4 * 1024, rel=1e-3),  # 4 digits kept
                            pytest.approx(1e-5 + 1e-9 * 4 * 4096, rel=1e-3)]
    assert (d["num_heads"], d["num_kv_heads"], d["kv_dtype"]) == (32, 8, "bfloat16")
    assert len(doc["decode_attention"]) == 3  # batch 1 and 4 at hd 128, batch 1 at hd 256
    # prefill: chunk = isl after context 0
    p = _curve(doc, "prefill_attention", batch=1)
    assert (p["context"], p["chunk"]) == (0, [16, 1024, 4096])
    assert p["seconds"][2] == pytest.approx(1e-5 + 1e-11 * 4096 ** 2, rel=1e-3)
    # all-reduce: bf16 elements → bytes, graph and eager
    ar = _curve(doc, "allreduce", mode="graph", tp=2)
    assert ar["bytes"] == [2048, 2097152] and ar["seconds"] == [4e-6, 4e-6]
    assert _curve(doc, "allreduce", mode="eager", tp=2)["seconds"] == [2e-5, 2e-5]
    moe = _curve(doc, "moe", distribution="balanced")
    assert (moe["tokens"], moe["seconds"]) == ([1, 64], [2e-4, 3e-4])
    assert {r["dtype"] for r in doc["moe"]} == {"bfloat16"}  # the ModelOpt fp8 row dropped


def test_default_keeps_only_what_the_catalog_reads(database, tmp_path):
    doc = _import(database, tmp_path / "h100.yaml")
    assert {r["head_dim"] for r in doc["decode_attention"]} == {128}  # no catalog model: 256
    assert [r["batch"] for r in doc["prefill_attention"]] == [1]
    assert {r["distribution"] for r in doc["moe"]} == {"balanced"}
    assert "of" in doc["tables"]["decode_attention"]["kept"]


def test_vllm_version_pick(database, tmp_path, capsys):
    doc = _import(database, tmp_path / "v19.yaml", "--vllm-version", "0.19.0", "--all-shapes")
    assert doc["tables"]["gemm"]["vllm"] == "0.19.0"
    assert _curve(doc, "gemm", dtype="bfloat16")["seconds"] == [5e-4]
    assert doc["tables"]["moe"]["vllm"] == "0.24.0"  # no 0.19.0 MoE table: the newest
    assert "no vLLM 0.19.0 table" in capsys.readouterr().err


def test_imported_file_drives_the_cost_model(database, tmp_path, capsys):
    out = tmp_path / "h100.yaml"
    doc = _import(database, out)
    capsys.readouterr()

    def ops(batch):
        main(["estimate", CONFIG, "--batch-size", str(batch), "--context",
              "1024", "--json", "--set", "hardware.name=h100-sxm",
              "--set", f"hardware.calibration={out}"])
        return {o["name"]: o for o in json.loads(capsys.readouterr().out)["ops"]}

    src = "aiconfigurator-9.9.9/vllm-0.24.0"
    one = ops(1)
    row = _curve(doc, "decode_attention", head_dim=128, batch=1)
    assert one["attn"]["provenance"] == f"calibration:{src}"
    # all 32 layers: the measured kernel at (batch 1, context 1024) + reshape_and_cache (2 us)
    assert one["attn"]["seconds"] == pytest.approx(32 * (row["seconds"][0] + 2e-6))
    assert one["qkv_proj"]["provenance"].endswith(src)
    assert one["rotary_emb"]["provenance"] == "roofline:default"
    eight = ops(8)  # batch 8 > the measured 4: roofline at the nearest measured efficiency
    assert eight["attn"]["provenance"] == f"roofline:nearest/{src}"


def test_check_reports_each_family(database, tmp_path, capsys):
    out = tmp_path / "h100.yaml"
    _import(database, out, "--all-shapes")
    capsys.readouterr()
    main(["calibrate", "check", str(out), "--json"])
    res = json.loads(capsys.readouterr().out)["families"]
    assert set(res) == {"gemm", "decode_attention", "prefill_attention", "allreduce", "moe"}
    assert all(r["median_abs_err"] == 0 for r in res.values())  # exact at measured points
    # leave-one-out on the two-point all-reduce curves (4 us at 2 KiB and 2 MiB): 2 KiB from
    # 2 MiB is roofline-scaled down, floored at 4 us (error 0); 2 MiB from 2 KiB is scaled up
    # 1024x (error 1023): median over the 4 points 511.5
    assert res["allreduce"]["loo_median_abs_err"] == pytest.approx(511.5)
    assert res["allreduce"]["points"] == 4 and res["allreduce"]["curves"] == 2
    main(["calibrate", "check", str(out)])
    text = capsys.readouterr().out
    assert "measured by NVIDIA" in text and "prefill_attention" in text


def test_report_refuses_an_imported_file(database, tmp_path, capsys):
    out = tmp_path / "h100.json"
    _import(database, out)
    code, _, err = _run(["calibrate", "report", str(out)], capsys)
    assert code == 2 and "use `simulate calibrate check FILE`" in err and err.count("\n") == 1


def test_missing_extra_is_one_line(monkeypatch, capsys):
    real = A.importlib.util.find_spec
    monkeypatch.setattr(A.importlib.util, "find_spec",
                        lambda name, *a: None if name == "aiconfigurator_core" else real(name))
    code, _, err = _run(["calibrate", "import", "aiconfigurator", "--gpu", "h100-sxm"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "pip install 'servesim[aiconfigurator]'" in err


def test_missing_parquet_engine_is_one_line(database, monkeypatch, capsys):
    real = A.importlib.util.find_spec
    monkeypatch.setattr(A.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("pyarrow", "fastparquet")
                        else real(name))
    code, _, err = _run(["calibrate", "import", "aiconfigurator", "--gpu", "h100-sxm",
                         "--data-dir", str(database)], capsys)
    assert code == 2 and "servesim[aiconfigurator]" in err and err.count("\n") == 1


def test_unknown_gpu(capsys, database):
    code, _, err = _run(["calibrate", "import", "aiconfigurator", "--gpu", "a10g",
                         "--data-dir", str(database)], capsys)
    assert code == 2 and "--gpu a10g" in err and "h100-sxm (h100_sxm)" in err
