"""``simulate compare`` refuses what it cannot compare honestly: ``-o`` onto an input or an
unusable path, measured runs with no completed request, bad metric values, unknown AIPerf
units, stages at other loads, ambiguous pairings, a bad ``--itl-scale``; and malformed client
files are one-line errors (exit 2) naming the file and key, never internal errors."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import shutil
from pathlib import Path

import pytest
from servesim.reports import write_run
from servesim.reports.clients import load_measured
from servesim.reports.compare import compare_files
from servesim.simulator.cli import run_cli
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.errors import ServesimError
from servesim.simulator.runner import run_experiment

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parent / "fixtures" / "clients"
PROFILES = ROOT / "configs" / "profiles"


def cli(*args: object) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = run_cli([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def refused(*args: object) -> str:
    """``simulate compare ARGS`` exits 2 with one ``error:`` line and nothing on stdout."""
    rc, out, err = cli("compare", *args)
    lines = [ln for ln in err.splitlines() if not ln.startswith("warning: ")]
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert out == ""
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 20-request run at 4 req/s, written in every client format."""
    cfg = resolve_config(load_config(None, ["workload.num_prompts=20",
                                            "workload.request_rate=4"]))
    out = tmp_path_factory.mktemp("cmp") / "run"
    write_run(run_experiment(cfg, resolved=True), out,
              formats=["inference-perf", "guidellm", "aiperf"])
    return out


@pytest.fixture
def measured(run, tmp_path) -> Path:
    """The run's result.json as a vllm bench measurement (``simulated`` dropped)."""
    d = json.loads((run / "result.json").read_text())
    d.pop("simulated")
    p = tmp_path / "measured.json"
    p.write_text(json.dumps(d))
    return p


def _edited(src: Path, dst: Path, edit) -> Path:
    d = json.loads(src.read_text())
    edit(d)
    dst.write_text(json.dumps(d))
    return dst


# H1 -------------------------------------------------------------------------------------------


def test_output_onto_an_input_is_refused_and_nothing_is_written(run, measured, tmp_path):
    before = measured.read_bytes()
    assert refused(run, measured, "-o", measured) == \
        f"error: -o {measured}: is one of the inputs; choose another path"
    assert measured.read_bytes() == before
    other = tmp_path / "sub" / ".." / measured.name  # the same file by another spelling
    assert "is one of the inputs" in refused(run, measured, "-o", other)
    copy_run = tmp_path / "run2"
    shutil.copytree(run, copy_run)
    result = (copy_run / "result.json").read_bytes()
    for target in (copy_run / "result.json", copy_run / "cmp.csv"):
        assert refused(copy_run, measured, "-o", target) == \
            f"error: -o {target}: is inside the input folder {copy_run}; choose another path"
    assert (copy_run / "result.json").read_bytes() == result
    assert not (copy_run / "cmp.csv").exists()
    # the jsonl read beside an AIPerf export is an input too
    ap = copy_run / "profile_export_aiperf.json"
    jl = copy_run / "profile_export.jsonl"
    assert refused(run, ap, "-o", jl) == \
        f"error: -o {jl}: is one of the inputs; choose another path"


# M10 ------------------------------------------------------------------------------------------


def test_unusable_output_is_refused_before_the_table(run, measured, tmp_path):
    (tmp_path / "outdir").mkdir()
    (tmp_path / "keep.txt").write_text("x")
    assert refused(run, measured, "-o", tmp_path / "outdir") == \
        f"error: -o {tmp_path / 'outdir'}: is a directory; give a CSV file path"
    assert refused(run, measured, "-o", tmp_path / "keep.txt" / "x.csv") == \
        f"error: -o {tmp_path / 'keep.txt' / 'x.csv'}: {tmp_path / 'keep.txt'} is not a folder"
    assert refused(run, measured, "-o", "") == \
        "error: -o .: is a directory; give a CSV file path"
    if Path("/proc/self").is_dir():
        assert refused(run, measured, "-o", "/proc/servesim.csv").startswith(
            "error: -o /proc/servesim.csv: cannot write in /proc (")
    assert (tmp_path / "keep.txt").read_text() == "x"
    rc, _, err = cli("compare", run, measured, "-o", tmp_path / "new" / "dir" / "c.csv")
    assert rc == 0, err  # a folder that does not exist yet is still made
    assert (tmp_path / "new" / "dir" / "c.csv").read_text().startswith("request_rate,")
    assert not [p for p in tmp_path.rglob(".servesim-probe-*")]


# M1 -------------------------------------------------------------------------------------------


def test_a_measured_run_with_no_completed_request_is_refused(run, measured, tmp_path):
    def zero(d):
        d["completed"] = 0
        for k in list(d):
            if k.endswith(("_ms", "throughput")):
                d[k] = 0.0

    z = _edited(measured, tmp_path / "zero.json", zero)
    assert refused(run, z) == \
        f"error: {z}: measured run completed 0 requests; nothing to compare"

    def gl_zero(d):
        d["benchmarks"][0]["metrics"]["request_totals"]["successful"] = 0

    g = _edited(run / "benchmarks.json", tmp_path / "gl.json", gl_zero)
    assert refused(run, g) == \
        f"error: {g} (poisson@4): measured run completed 0 requests; nothing to compare"
    a = _edited(run / "profile_export_aiperf.json", tmp_path / "profile_export_aiperf.json",
                lambda d: d["request_count"].update(avg=0))
    assert refused(run, a) == \
        f"error: {a}: measured run completed 0 requests; nothing to compare"


# M2 / M3 / L1 / L3 ----------------------------------------------------------------------------


@pytest.mark.parametrize("raw, want", [
    ("-5", "expected a finite non-negative number, got -5"),
    ("Infinity", "expected a finite non-negative number, got inf"),
    ("1e400", "expected a finite non-negative number, got inf"),
    ("true", "expected a number, got True"),
    ('"abc"', "expected a number, got 'abc'"),
    ('"300"', "expected a number, got '300'"),
])
def test_bad_measured_vllm_values_name_the_file_and_key(run, tmp_path, raw, want):
    p = tmp_path / "m.json"
    p.write_text('{"request_rate": 4, "median_ttft_ms": 10, "mean_ttft_ms": ' + raw + "}")
    assert refused(run, p) == f"error: {p}: mean_ttft_ms: {want}"


def test_bad_client_values_name_the_file_and_key(run, tmp_path):
    ttft = "successes.latency.time_to_first_token.mean"
    for v, want in ((-1.0, "expected a finite non-negative number, got -1.0"),
                    (True, "expected a number, got True"),
                    ("0.3", "expected a number, got '0.3'")):
        f = _edited(run / "stage_0_lifecycle_metrics.json",
                    tmp_path / "stage_0_lifecycle_metrics.json",
                    lambda d, v=v: d["successes"]["latency"]["time_to_first_token"].update(
                        mean=v))
        assert refused(run, f) == f"error: {f}: {ttft}: {want}"
    a = _edited(run / "profile_export_aiperf.json", tmp_path / "profile_export_aiperf.json",
                lambda d: d["time_to_first_token"].update(avg=-3))
    assert refused(run, a) == \
        f"error: {a}: time_to_first_token.avg: expected a finite non-negative number, got -3"


# M4 -------------------------------------------------------------------------------------------


def test_aiperf_units(run, tmp_path):
    src = run / "profile_export_aiperf.json"
    ms = json.loads(src.read_text())["time_to_first_token"]["avg"]
    for unit in ("furlongs", 5):
        a = _edited(src, tmp_path / "profile_export_aiperf.json",
                    lambda d, u=unit: d["time_to_first_token"].update(unit=u))
        assert refused(run, a) == (f"error: {a}: time_to_first_token.unit: unknown unit "
                                   f"{unit!r} (expected ns, us, ms, s)")
    for unit, scale in (("seconds", 1e3), ("s", 1e3), ("us", 1e-3), ("Milliseconds", 1.0)):
        a = _edited(src, tmp_path / "profile_export_aiperf.json",
                    lambda d, u=unit, s=scale: d["time_to_first_token"].update(
                        unit=u, avg=d["time_to_first_token"]["avg"] / s))
        assert load_measured(a)[0]["mean_ttft_ms"] == pytest.approx(ms, rel=1e-12), unit


# M5 -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def staged_runs(tmp_path_factory):
    """The two shipped profiles, simulated: inference-perf at 4 then 8 req/s, GuideLLM at
    concurrency 4 then 16 (written in every format)."""
    out = {}
    for name, prof in (("rate", "inference_perf_shared_prefix.yaml"),
                       ("conc", "guidellm_concurrent.json")):
        cfg = resolve_config(load_config(None, ["workload.kind=profile",
                                                f"workload.path={PROFILES / prof}"]))
        out[name] = tmp_path_factory.mktemp("staged") / name
        write_run(run_experiment(cfg, resolved=True), out[name],
                  formats=["inference-perf", "guidellm"])
    return out


def test_stages_at_other_loads_are_refused(staged_runs, tmp_path):
    rate, conc = staged_runs["rate"], staged_runs["conc"]
    gl = FIX / "guidellm_benchmarks.json"
    assert refused(rate, gl) == (
        f"error: {gl}: measured stage 0 (concurrent@4) is at request_rate inf, max_concurrency 4 "
        f"but simulated stage 0 (rate=4) is at request_rate 4; simulate the same profile")
    stages = tmp_path / "ip"
    stages.mkdir()
    for k in (0, 1):
        shutil.copy(conc / f"stage_{k}_lifecycle_metrics.json", stages)
    msg = refused(rate, stages)
    assert msg.startswith(f"error: {stages / 'stage_0_lifecycle_metrics.json'}: measured stage "
                          "0 (stage_0) is at request_rate ") and "max_concurrency 4 but " \
        "simulated stage 0 (rate=4) is at request_rate 4; simulate the same profile" in msg
    # the same profile pairs, closed loops included (inference-perf gives the achieved rate)
    for sim, meas in ((conc, stages), (conc, gl), (conc, conc / "benchmarks.json"),
                      (rate, FIX / "inference_perf")):
        rows = compare_files([sim, meas])
        assert len({r["stage"] for r in rows}) == 2, (sim, meas)


# M6 -------------------------------------------------------------------------------------------


def test_guidellm_itl_percentiles_are_not_compared(run):
    rows = compare_files([run, run / "benchmarks.json"])
    itl = {r["metric"]: r for r in rows if "itl" in r["metric"]}
    for k in ("median_itl_ms", "p99_itl_ms"):
        assert itl[k]["status"] == "not in GuideLLM" and math.isnan(itl[k]["measured"])
    assert itl["mean_itl_ms"]["status"] == "ok"  # the weighted mean of gaps is exact
    assert abs(itl["mean_itl_ms"]["rel_error_pct"]) < 1e-6
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 13  # the latencies round-trip exactly (before: median ITL -59.5%)
    assert all(abs(r["rel_error_pct"]) < 1e-6 for r in ok if r["metric"].endswith("_ms"))
    rc, out, _ = cli("compare", run, run / "benchmarks.json")
    assert rc == 0 and "not in GuideLLM" in out
    assert "not compared (missing on one side): median_itl_ms, p99_itl_ms" in out


# M7 -------------------------------------------------------------------------------------------


def _gl(edit):
    def f(d):
        edit(d["benchmarks"][0])
    return f


def _req0(b):
    return b["requests"]["successful"][0]


B = "benchmarks[0]"
R = f"{B}.requests.successful[0]"
CLIENT_CASES = [
    ("profile_export_aiperf.json", lambda d: d.update(request_count={"avg": "abc"}),
     "request_count.avg: expected a number, got 'abc'"),
    ("profile_export_aiperf.json", lambda d: d.update(request_count={"avg": math.inf}),
     "request_count.avg: expected a finite non-negative number, got inf"),
    ("profile_export_aiperf.json", lambda d: d.update(error_request_count={"avg": "x"}),
     "error_request_count.avg: expected a number, got 'x'"),
    ("profile_export_aiperf.json", lambda d: d.update(input_config={"loadgen": "x"}),
     "input_config.loadgen: expected an object, got 'x'"),
    ("benchmarks.json", lambda d: d.update(benchmarks=[{"metrics": 5}]),
     f"{B}.metrics: expected an object, got 5"),
    ("benchmarks.json", _gl(lambda b: b.update(config="x")),
     f"{B}.config: expected an object, got 'x'"),
    ("benchmarks.json", _gl(lambda b: b["config"].update(strategy="poisson")),
     f"{B}.config.strategy: expected an object, got 'poisson'"),
    ("benchmarks.json",
     _gl(lambda b: b["metrics"]["time_to_first_token_ms"]["successful"].update(
         percentiles=[1])),
     f"{B}.metrics.time_to_first_token_ms.successful.percentiles: expected an object, got [1]"),
    ("benchmarks.json", _gl(lambda b: b.update(requests="x")),
     f"{B}.requests: expected an object, got 'x'"),
    ("benchmarks.json", _gl(lambda b: b["metrics"]["request_totals"].update(errored="x")),
     f"{B}.metrics.request_totals.errored: expected a number, got 'x'"),
    ("benchmarks.json", _gl(lambda b: _req0(b).update(info="x")),
     f"{R}.info: expected an object, got 'x'"),
    ("benchmarks.json", _gl(lambda b: _req0(b)["info"]["timings"].update(request_start="a")),
     f"{R}.info.timings.request_start: expected a number, got 'a'"),
    ("benchmarks.json", _gl(lambda b: _req0(b)["output_metrics"].update(total_tokens="5")),
     f"{R}.output_metrics.total_tokens: expected a number, got '5'"),
    ("stage_0_lifecycle_metrics.json", lambda d: d.update(successes="x"),
     "successes: expected an object, got 'x'"),
    ("stage_0_lifecycle_metrics.json", lambda d: d["successes"].update(latency=[1]),
     "successes.latency: expected an object, got [1]"),
    ("stage_0_lifecycle_metrics.json", lambda d: d.update(load_summary=5),
     "load_summary: expected an object, got 5"),
    ("stage_0_lifecycle_metrics.json",
     lambda d: d["load_summary"].update(requested_rate="abc"),
     "load_summary.requested_rate: expected a positive number or 'inf', got 'abc'"),
]


@pytest.mark.parametrize("name, edit, want", CLIENT_CASES)
def test_malformed_client_files_are_one_line_errors(run, tmp_path, name, edit, want):
    f = _edited(run / name, tmp_path / name, edit)
    assert refused(run, f) == f"error: {f}: {want}"


@pytest.mark.parametrize("lines, want", [
    (['{"metrics": {}}', "not json"], ":2: not valid JSON ("),
    (["[1, 2]"], ":1: expected a JSON object, got [1, 2]"),
    (['{"metrics": "x"}'], ":1: metrics: expected an object, got 'x'"),
    (['{"metadata": "x"}'], ":1: metadata: expected an object, got 'x'"),
    (['{"metrics": {"time_to_first_token": {"value": "x", "unit": "ms"}}}'],
     ":1: metrics.time_to_first_token.value: expected a number, got 'x'"),
    (None, ": not UTF-8 text (invalid start byte at byte 0)"),
])
def test_bad_aiperf_record_files_are_one_line_errors(run, tmp_path, lines, want):
    shutil.copy(run / "profile_export_aiperf.json", tmp_path)
    jl = tmp_path / "profile_export.jsonl"
    if lines is None:
        jl.write_bytes(b"\xff\xfe\n")
    else:
        jl.write_text("\n".join(lines) + "\n")
    assert refused(run, tmp_path).startswith(f"error: {jl}{want}")


def test_client_folders_with_a_folder_for_a_file(run, tmp_path):
    (tmp_path / "gl" / "benchmarks.json").mkdir(parents=True)
    assert refused(run, tmp_path / "gl") == \
        f"error: {tmp_path / 'gl' / 'benchmarks.json'}: not a file"
    (tmp_path / "ip" / "stage_x_lifecycle_metrics.json").mkdir(parents=True)
    assert refused(run, tmp_path / "ip") == \
        f"error: {tmp_path / 'ip' / 'stage_x_lifecycle_metrics.json'}: not a file"


def test_huge_guidellm_token_counts_allocate_nothing(run, tmp_path):
    """1e12 output tokens used to build a 1e12-element ITL array (MemoryError)."""
    d = json.loads((run / "benchmarks.json").read_text())
    reqs = d["benchmarks"][0]["requests"]["successful"]
    big = copy.deepcopy(reqs[0])
    big["output_metrics"]["total_tokens"] = 1e12
    t = big["info"]["timings"]
    reqs[:] = [big]
    f = tmp_path / "benchmarks.json"
    f.write_text(json.dumps(d))
    doc = load_measured(f)[0]
    gap = (t["last_token_iteration"] - t["first_token_iteration"]) / (1e12 - 1)
    assert doc["mean_itl_ms"] == pytest.approx(gap * 1e3, rel=1e-9)
    assert "median_itl_ms" not in doc and "p99_itl_ms" not in doc


# L2 / L9 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", ["0", "-2", "nan", "inf"])
def test_itl_scale_must_be_finite_and_positive(run, measured, v):
    assert refused(run, measured, "--itl-scale", v) == \
        f"error: --itl-scale: expected a finite number > 0, got {float(v)!r}"


def test_two_simulations_at_the_same_load_are_ambiguous(tmp_path):
    def doc(name, **kw):
        p = tmp_path / name
        p.write_text(json.dumps({"mean_ttft_ms": 10.0, **kw}))
        return p

    a = doc("a.json", simulated=True, request_rate=12.0, max_concurrency=None)
    b = doc("b.json", simulated=True, request_rate=12.0, max_concurrency=None)
    m = doc("m.json", request_rate=12.0, max_concurrency=None)
    with pytest.raises(ServesimError) as e:
        compare_files([a, b, m])
    assert str(e.value) == f"{m}: 2 simulated results match its request_rate 12 ({a}, {b}); " \
        "give one per load"
    # a concurrency sweep at rate inf pairs by max_concurrency
    c4 = doc("c4.json", simulated=True, request_rate="inf", max_concurrency=4)
    c8 = doc("c8.json", simulated=True, request_rate="inf", max_concurrency=8)
    m4 = doc("m4.json", request_rate="inf", max_concurrency=4)
    m8 = doc("m8.json", request_rate="inf", max_concurrency=8)
    rows = compare_files([c4, c8, m8, m4])
    assert {(Path(r["sim_file"]).name, Path(r["measured_file"]).name) for r in rows} == {
        ("c8.json", "m8.json"), ("c4.json", "m4.json")}
