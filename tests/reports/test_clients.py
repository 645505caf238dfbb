"""Other clients' result files: import as measurements, export our runs, round trips, and
``simulate compare`` against an inference-perf stage folder and a GuideLLM benchmarks.json
(fixtures written from each tool's documented result schema)."""

import json
from pathlib import Path

import pytest
from servesim.reports import write_run
from servesim.reports.clients import detect_result, load_measured
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parent / "fixtures" / "clients"
PROFILES = ROOT / "configs" / "profiles"
METRICS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median",
                                                                          "p99")]


@pytest.fixture(scope="module")
def staged_run(tmp_path_factory):
    """The shipped two-stage inference-perf profile, simulated, written in every format."""
    cfg = resolve_config(load_config(None, [
        "workload.kind=profile",
        f"workload.path={PROFILES / 'inference_perf_shared_prefix.yaml'}"]))
    out = tmp_path_factory.mktemp("clients") / "run"
    bench = write_run(run_experiment(cfg, resolved=True), out,
                      formats=["inference-perf", "guidellm", "aiperf"])
    return out, bench


def test_fixtures_are_read_with_the_documented_conversions():
    ip = load_measured(FIX / "inference_perf")
    assert [d["stage"] for d in ip] == [0, 1] and detect_result(FIX / "inference_perf")
    assert ip[0]["mean_ttft_ms"] == pytest.approx(31.0)  # seconds -> ms
    assert ip[1]["p99_itl_ms"] == pytest.approx(13.0 * 1.6)
    assert ip[1]["request_rate"] == 8 and ip[0]["request_throughput"] == 3.9
    assert load_measured(FIX / "inference_perf", itl_scale=2)[0]["mean_itl_ms"] == \
        pytest.approx(24.8)  # SSE-line timestamps halve ITL
    gl = load_measured(FIX / "guidellm_benchmarks.json")
    assert [d["label"] for d in gl] == ["concurrent@4", "concurrent@16"]
    assert gl[0]["mean_itl_ms"] == 12.6 and gl[0]["median_tpot_ms"] == pytest.approx(12.6 * 0.98)
    assert gl[1]["mean_e2el_ms"] == pytest.approx(2700.0) and "mean_tpot_ms" not in gl[1] or \
        gl[1].get("mean_tpot_ms") is None
    ap = load_measured(FIX / "aiperf")
    assert ap[0]["stage"] is None and ap[0]["mean_tpot_ms"] == 13.6  # AIPerf ITL = vLLM TPOT
    assert ap[0]["request_throughput"] == 5.8


def test_export_then_import_round_trips(staged_run):
    out, bench = staged_run
    stages = bench["stages"]
    for fmt, where in (("inference-perf", out / "stage_0_lifecycle_metrics.json"),
                       ("guidellm", out / "benchmarks.json")):
        docs = load_measured(where)
        if fmt == "inference-perf":
            docs += load_measured(out / "stage_1_lifecycle_metrics.json")
        assert len(docs) == 2, fmt
        for doc, st in zip(docs, stages):
            for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "median_e2el_ms",
                      "mean_itl_ms", "request_throughput", "output_throughput"):
                assert doc[k] == pytest.approx(st[k], rel=1e-9), (fmt, k)
            if fmt == "inference-perf":
                for k in METRICS:
                    assert doc[k] == pytest.approx(st[k], rel=1e-9), (fmt, k)
    assert detect_result(out) is None  # a run folder is a simulation, whatever else it holds
    ap = load_measured(out / "profile_export_aiperf.json")[0]
    for k in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "mean_e2el_ms"):
        assert ap[k] == pytest.approx(bench[k], rel=1e-9), k
    assert ap["request_throughput"] == pytest.approx(bench["request_throughput"], rel=1e-9)
    # the per-request jsonl carries the phase of every request
    recs = [json.loads(x) for x in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(recs) == 120 and {r["metadata"]["benchmark_phase"] for r in recs} == {"profiling"}


def test_compare_a_staged_simulation_with_an_inference_perf_stage_folder(staged_run):
    from servesim.simulator.cli import app

    out, _ = staged_run
    r = CliRunner().invoke(app, ["compare", str(out), str(FIX / "inference_perf"), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["rows"]
    assert {row["stage"] for row in rows} == {"stage_0", "stage_1"}
    ttft = [row for row in rows if row["metric"] == "mean_ttft_ms"]
    assert [row["measured"] for row in ttft] == pytest.approx([31.0, 36.0])
    assert all(row["status"] == "ok" for row in rows)
    r = CliRunner().invoke(app, ["compare", str(out / "result.json"),
                                 str(FIX / "inference_perf" / "stage_1_lifecycle_metrics.json")])
    assert r.exit_code == 0, r.output
    assert "mean_ttft_ms" in r.output and "mean |relative error|" in r.output


def test_compare_with_a_guidellm_benchmarks_file(tmp_path):
    from servesim.simulator.cli import app

    cfg = resolve_config(load_config(None, [
        "workload.kind=profile", f"workload.path={PROFILES / 'guidellm_concurrent.json'}"]))
    write_run(run_experiment(cfg, resolved=True), tmp_path / "sim")
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "sim"),
                                 str(FIX / "guidellm_benchmarks.json"), "-o",
                                 str(tmp_path / "cmp.csv")])
    assert r.exit_code == 0, r.output
    for word in ("concurrent@4", "concurrent@16", "mean_ttft_ms", "mean_itl_ms",
                 "request_throughput"):
        assert word in r.output
    rows = (tmp_path / "cmp.csv").read_text().splitlines()
    assert rows[0].endswith(",stage,side") and len(rows) == 1 + 2 * 15


def test_compare_refuses_mismatched_stage_counts(staged_run):
    from servesim.reports.compare import compare_files
    from servesim.simulator.errors import ServesimError

    out, _ = staged_run
    with pytest.raises(ServesimError, match="4 measured stages, but the simulation has 2"):
        compare_files([out / "result.json", FIX / "guidellm_benchmarks.json",
                       FIX / "inference_perf"])


def test_run_format_option_through_the_cli(tmp_path):
    from servesim.simulator.cli import app

    r = CliRunner().invoke(app, ["run", str(ROOT / "configs" / "llama8b_a100.yaml"),
                                 "--set", "workload.num_prompts=20", "-o",
                                 str(tmp_path / "r"), "-q", "--format", "guidellm,aiperf"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "r" / "benchmarks.json").is_file()
    assert (tmp_path / "r" / "profile_export_aiperf.json").is_file()
    docs = load_measured(tmp_path / "r" / "benchmarks.json")
    assert len(docs) == 1 and docs[0]["completed"] == 20
    r = CliRunner().invoke(app, ["run", str(ROOT / "configs" / "llama8b_a100.yaml"),
                                 "-o", str(tmp_path / "x"), "--format", "locust"])
    assert r.exit_code != 0
