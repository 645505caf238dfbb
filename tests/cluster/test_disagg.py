"""P/D disaggregation (simulator/cluster/disagg.py): vLLM NixlConnector semantics, timing."""

import csv
import io

import numpy as np
import pytest
from servesim.simulator.config import resolve_config, validate_tree
from servesim.simulator.runner import run_experiment


def pd_config(num_prompts=1, rate="inf", link=None, prefix_len=0, **wl):
    tree = {
        "model": {"name": "llama-3.1-8b", "max_model_len": 8192},
        "hardware": {"name": "h100-sxm"},
        "workload": {"kind": "random", "num_prompts": num_prompts, "input_len": 2048,
                     "output_len": 8, "request_rate": rate, "prefix_len": prefix_len,
                     "seed": 0, **wl},
        "cluster": {"instances": [{"name": "p", "role": "prefill", "replicas": 1},
                                  {"name": "d", "role": "decode", "replicas": 1}],
                    "kv_transfer": link or {"link": "rdma"}},
    }
    return resolve_config(validate_tree(tree, "test"))


def routing(res):
    return list(csv.DictReader(io.StringIO(res.files["routing.csv"])))


def test_ttft_is_prefill_plus_transfer_plus_first_decode_step():
    """One request: the prefill instance runs the prompt (max_tokens=1), the link moves its
    KV (overhead + latency + bytes / bandwidth), the decode instance recomputes the last
    prompt token and samples the first output token. Nothing is prefilled twice."""
    link = {"link": "rdma", "bandwidth_gbps": 10.0, "latency_us": 100.0, "overhead_us": 400.0}
    res = run_experiment(pd_config(link=link), resolved=True)
    (row,) = routing(res)
    subs = dict(res.instances)
    p, d = subs["p-0"], subs["d-0"]
    # the prefill instance: one request, one token, its TTFT = the prefill (one step)
    assert p.requests["output_len"][0] == 1
    p_steps = p.steps["step_seconds"]
    assert len(p_steps) == 1
    assert p.requests["first_token_s"][0] == pytest.approx(float(row["prefill_end_s"]))
    assert p.requests["ttft_s"][0] == pytest.approx(p_steps[0])
    assert p.steps["num_prefill_tokens"][0] == 2048  # the whole prompt
    # the transfer: 2048 tokens × KV bytes per token per GPU at 10 GB/s + 0.5 ms
    kvbpt = res.capacity["kv_bytes_per_token"]
    expect = 400e-6 + 100e-6 + 2048 * kvbpt / 10e9
    assert float(row["kv_transfer_s"]) == pytest.approx(expect)
    assert int(row["kv_transfer_tokens"]) == 2048
    assert float(row["kv_transfer_start_s"]) == pytest.approx(float(row["prefill_end_s"]))
    # the decode instance starts only when the KV has arrived, with one token to compute
    assert float(row["decode_first_scheduled_s"]) >= float(row["kv_transfer_end_s"]) - 1e-12
    assert d.steps["num_prefill_tokens"][0] == 0 and d.steps["num_decode_reqs"][0] == 1
    # client TTFT = prefill + transfer + the decode step that samples the first token
    ttft = res.requests["ttft_s"][0]
    assert ttft == pytest.approx(p_steps[0] + expect + d.steps["step_seconds"][0])
    assert res.requests["output_len"][0] == 8
    assert res.requests["finished_reason"][0] == "length"
    # the prefill instance held the blocks until the read, then freed them
    assert p.steps["vllm:kv_cache_usage_perc"][-1] > 0


def test_decode_side_prefix_hits_shrink_the_transfer_and_prefill_blocks_are_freed():
    cfg = pd_config(num_prompts=6, rate=2.0, prefix_len=1024)
    res = run_experiment(cfg, resolved=True)
    rows = routing(res)
    toks = [int(r["kv_transfer_tokens"]) for r in rows]
    assert toks[0] == int(res.requests["prompt_len"][0])
    # later requests share 1024 prompt tokens the decode instance already caches (64 blocks)
    assert all(t == pl - 1024 for t, pl in zip(toks[1:], res.requests["prompt_len"][1:]))
    assert (res.requests["finished_reason"] == "length").all()
    assert res.extras["kv_transfers"] == 6
    assert 0 < res.extras["kv_link_utilization"]["d-0"] < 1
    # nothing leaks: after the run every block of every instance is free again
    for name, sub in res.instances:
        assert sub.counters["num_preemptions"] == 0, name


def test_pd_results_layout_and_extras(tmp_path):
    from servesim.reports import write_run

    res = run_experiment(pd_config(num_prompts=4, rate=4.0), resolved=True)
    out = tmp_path / "run"
    bench = write_run(res, out)
    assert (out / "routing.csv").is_file()
    for name in ("p-0", "d-0"):
        d = out / "instances" / name
        assert {f.name for f in d.iterdir()} >= {"result.json", "requests.csv",
                                                 "timeseries.csv", "config.resolved.yaml"}
    assert bench["num_gpus"] == 2
    assert bench["cluster_router"] == "least_load"
    roles = {i["name"]: i["role"] for i in bench["cluster_instances"]}
    assert roles == {"p-0": "prefill", "d-0": "decode"}
    assert bench["completed"] == 4
    assert np.isfinite(bench["mean_kv_transfer_ms"])
