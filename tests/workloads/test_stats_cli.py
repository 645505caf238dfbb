"""trace stats / convert: values, CLI, streaming memory."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import SHARED_TRACES
from servesim.simulator.cli import app
from servesim.workloads.importers import read_trace
from servesim.workloads.stats import LengthHistogram, SeenBlocks, trace_stats
from test_importers import AZURE23, CANONICAL, MOONCAKE
from typer.testing import CliRunner

runner = CliRunner()


def test_histogram_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.integers(1, 5000, 9999), [1 << 25, 7]])
    h = LengthHistogram()
    for part in np.array_split(x, 7):
        h.add(part)
    qs = [0, 1, 50, 90, 99, 99.9, 100]
    np.testing.assert_allclose(h.percentiles(qs), np.percentile(x, qs), rtol=1e-12)
    assert h.max() == 1 << 25


def test_bloom_fallback_agrees():
    s = SeenBlocks(exact_max=100)
    s.add(list(range(1000)))
    assert s.approximate
    assert s.count_seen(list(range(1000))) == 1000
    assert s.count_seen(list(range(10**6, 10**6 + 1000))) < 5


def test_stats_values(write):
    s = trace_stats(write("a.csv", AZURE23))
    assert s["requests"] == 3 and s["format"] == "azure2023"
    assert s["duration_s"] == pytest.approx(4.31941)
    assert s["mean_rate_rps"] == pytest.approx(2 / 4.31941)
    assert s["prompt_len"]["p50"] == 374 and s["prompt_len"]["max"] == 396
    assert s["prefix_reuse"] == 0 and not s["has_prefix_ids"]
    m = trace_stats(write("d.jsonl", MOONCAKE), block_size=16)
    # request 2 reuses 64 of 93 blocks, request 3 reuses 32 of 37
    total = 1100 // 16 + 1500 // 16 + 600 // 16
    assert m["prefix_reuse"] == pytest.approx((64 + 32) / total)


def test_cli_stats_and_convert(write, tmp_path):
    p = write("d.jsonl", MOONCAKE)
    res = runner.invoke(app, ["trace", "stats", str(p), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["requests"] == 3
    res = runner.invoke(app, ["trace", "stats", str(p)])
    assert res.exit_code == 0 and "requests" in res.output
    out = tmp_path / "out.csv"
    res = runner.invoke(app, ["trace", "convert", str(p), "-o", str(out)])
    assert res.exit_code == 0, res.output
    a = list(read_trace(p, block_size=16))
    b = list(read_trace(out, block_size=16))
    assert [(x.prompt_len, x.output_len, x.prefix_block_ids) for x in a] == [
        (x.prompt_len, x.output_len, x.prefix_block_ids) for x in b]
    assert [x.arrival_s for x in b] == [0.0, 0.0, 3.0]
    c = write("f.csv", CANONICAL)
    out2 = tmp_path / "out2.csv"
    assert runner.invoke(app, ["trace", "convert", str(c), "-o", str(out2)]).exit_code == 0
    x = list(read_trace(out2))
    assert x[1].parent_id == "a" and x[1].lora == "my-lora" and x[1].think_time_s == 2.5


def test_cli_bad_row_one_line(write):
    from servesim.simulator.cli import main

    p = write("a.csv", AZURE23.replace("396,109", "x,109"))
    with pytest.raises(SystemExit) as e:
        main(["trace", "stats", str(p)])
    assert e.value.code == 2
    res = runner.invoke(app, ["trace", "stats", str(p), "--skip-bad-rows", "--json"])
    assert json.loads(res.output)["skipped_bad_rows"] == 1


def test_stats_streams_200k_rows(tmp_path):
    p = tmp_path / "big.csv"
    n = 200_000
    rng = np.random.default_rng(0)
    t = np.cumsum(rng.exponential(0.01, n))
    pl = rng.integers(1, 4000, n)
    ol = rng.integers(1, 500, n)
    with open(p, "w") as f:
        f.write("arrival_s,prompt_len,output_len\n")
        for i in range(0, n, 50_000):
            f.writelines(f"{a!r},{b},{c}\n" for a, b, c in zip(
                t[i:i + 50_000].tolist(), pl[i:i + 50_000].tolist(), ol[i:i + 50_000].tolist()))
    s = trace_stats(p)
    assert s["requests"] == n
    assert s["prompt_len"]["p99"] == np.percentile(pl, 99)
    assert s["interarrival_cv"] == pytest.approx(np.std(np.diff(t)) / np.mean(np.diff(t)))
    # bounded memory: peak RSS of a process computing the stats vs one that only imports
    code = ("import resource, sys; from servesim.workloads.stats import trace_stats; "
            "sys.argv[1] != '-' and trace_stats(sys.argv[1]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    rss = [int(subprocess.run([sys.executable, "-c", code, a], capture_output=True, text=True,
                              check=True).stdout) for a in ("-", str(p))]
    assert rss[1] - rss[0] < 25_000  # KiB; the rows as Python objects would take ~60 MB


@pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="shared/traces not present")
def test_acceptance_azure_conv_stats():
    res = runner.invoke(app, ["trace", "stats", str(SHARED_TRACES / "azure2023_conv.csv")])
    assert res.exit_code == 0 and "19,366" in res.output
