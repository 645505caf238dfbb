"""Fuzzing the CLI in-process (hypothesis): generated configs (valid and invalid: huge values,
wrong types, unicode, broken YAML, non-UTF-8 bytes), trace rows and argument lists.

Contract: exit code 0 or 2; on 2 exactly one ``error:`` line on stderr naming the file (and
the key or line); never a traceback; never a partially written output folder.

CI runs the default profile (510 cases, under a minute on 2 busy cores); ``SERVESIM_FUZZ=long`` runs 20×
more examples of each (``pytest tests/reliability/test_fuzz.py``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .cli_harness import check_contract, cli, no_partial_output
from .conftest import CONFIG

SCALE = 20 if os.environ.get("SERVESIM_FUZZ") == "long" else 1
COMMON = {"deadline": None, "suppress_health_check": list(HealthCheck), "derandomize": True}

BASE = yaml.safe_load(CONFIG.read_text())
BASE["workload"]["num_prompts"] = 8
KEYS = [
    "model.name", "model.max_model_len", "hardware.name", "hardware.calibration",
    "parallel.tensor_parallel_size", "parallel.pipeline_parallel_size",
    "parallel.data_parallel_size", "cache.block_size", "cache.gpu_memory_utilization",
    "cache.enable_prefix_caching", "cache.cache_dtype", "cache.num_gpu_blocks_override",
    "cache.kv_cache_memory_bytes", "optimization_level", "performance_mode", "cpu_offload_gb",
    "model.quantization",
    "cache.allocator", "scheduler.policy", "scheduler.max_num_seqs",
    "scheduler.max_num_batched_tokens", "scheduler.long_prefill_token_threshold",
    "scheduler.enable_chunked_prefill", "compilation.cudagraph_mode",
    "compilation.cudagraph_capture_sizes", "workload.kind", "workload.num_prompts",
    "workload.input_len", "workload.output_len", "workload.range_ratio", "workload.prefix_len",
    "workload.request_rate", "workload.burstiness", "workload.seed", "workload.max_concurrency",
    "workload.path", "workload.format", "slo.ttft_ms", "slo.tpot_ms", "output.label",
    "output.percentile_metrics", "output.metric_percentiles", "output.timeseries_interval_s",
    "output.save_detailed", "nosuchsection.key", "model.nosuchkey",
]
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(-10**30, 10**30), st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 10**100]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30), st.sampled_from(["fcfs", "random", "trace", "auto", "inf", "∞",
                                           "llama-3.1-8b", "h100-sxm", "ttft,tpot", "99,99.9",
                                           "\x00", "💥" * 50, "a" * 10_000]),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=5),
                   st.dictionaries(st.text(max_size=8), SCALARS, max_size=3))


@st.composite
def config_trees(draw):
    tree = yaml.safe_load(yaml.safe_dump(BASE))
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(KEYS)).split(".")
        node = tree
        for k in key[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        if draw(st.integers(0, 9)) == 0:
            node.pop(key[-1], None)
        else:
            node[key[-1]] = draw(VALUES)
    if draw(st.integers(0, 19)) == 0:
        tree[draw(st.sampled_from(list(tree)))] = draw(SCALARS)
    return tree


RAW = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.sampled_from([b"", b"---\n", b"[1, 2]\n", b"model: [\n", b"a: &x 1\nb: *y\n",
                     b"model:\n  name: x\nmodel:\n  name: y\n", b"\xef\xbb\xbfmodel: {}\n",
                     b"workload: !!python/object:os.system ls\n", b"{{{{{{{{{{{{{{{{\n"]),
)


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="servesim-fuzz-"))


@settings(max_examples=280 * SCALE, **COMMON)
@given(tree=config_trees())
def test_fuzz_configs_validate(tree):
    d = _tmp()
    try:
        p = d / "cfg.yaml"
        p.write_text(yaml.safe_dump(tree, allow_unicode=True))
        o = cli("validate", p)
        check_contract(o, str(p))
    finally:
        shutil.rmtree(d)


@settings(max_examples=60 * SCALE, **COMMON)
@given(raw=RAW)
def test_fuzz_raw_config_bytes(raw):
    d = _tmp()
    try:
        p = d / "raw.yaml"
        p.write_bytes(raw)
        o = cli("validate", p)
        check_contract(o, str(p))
    finally:
        shutil.rmtree(d)


CELL = st.one_of(st.integers(-5, 5000).map(str), st.floats(allow_nan=True).map(repr),
                 st.text(max_size=6), st.sampled_from(["", " ", "1e3", "NaN", "inf", "-0",
                                                      "0x10", "1,5", '"', "\ufeff"]))
ROW = st.lists(CELL, min_size=0, max_size=5)


@settings(max_examples=80 * SCALE, **COMMON)
@given(rows=st.lists(ROW, max_size=8), header=st.sampled_from([
    "arrival_s,prompt_len,output_len", "TIMESTAMP,ContextTokens,GeneratedTokens",
    "arrived_at,num_prefill_tokens,num_decode_tokens", "x,y"]),
       skip=st.booleans(), junk=st.binary(max_size=6), gz=st.booleans())
def test_fuzz_trace_rows(rows, header, skip, junk, gz):
    import csv
    import gzip
    import io

    d = _tmp()
    try:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        data = (header + "\n").encode() + buf.getvalue().encode("utf-8", "surrogatepass")
        data += junk
        p = d / ("t.csv.gz" if gz else "t.csv")
        p.write_bytes(gzip.compress(data) if gz else data)
        args = ["--skip-bad-rows"] if skip else []
        check_contract(cli("trace", "stats", p, *args), str(p))
        o = cli("trace", "convert", p, "-o", d / "out" / "c.csv", *args)
        check_contract(o)
        out = d / "out" / "c.csv"
        assert o.rc == 0 or not out.exists()
        assert not [x for x in (d / "out").glob(".*")] if (d / "out").exists() else True
    finally:
        shutil.rmtree(d)


ARG = st.one_of(
    st.sampled_from(["run", "validate", "trace", "stats", "convert", "compare", "estimate",
                     "report", "--set", "-o", "--seed", "--json", "--overwrite", "-q", "--help",
                     "--batch-size", "--context", "--format", "workload.num_prompts=3",
                     "workload.num_prompts=0", "scheduler.policy=nope", "a.b.c=1", "=",
                     "--version", "-1", "4294967296", "1e9", "", "💥", "--no-such-flag"]),
    st.text(max_size=12),
)


@settings(max_examples=90 * SCALE, **COMMON)
@given(args=st.lists(ARG, max_size=7), with_config=st.booleans())
def test_fuzz_argument_lists(args, with_config):
    d = _tmp()
    try:
        cfg = d / "c.yaml"
        cfg.write_text(yaml.safe_dump(BASE))
        argv = list(args)
        if with_config:
            argv[1:1] = [str(cfg)]
        # keep generated runs small and inside the temp folder
        argv = [a.replace("-o", "--set") if a == "-o" else a for a in argv]
        if argv and argv[0] == "run":
            argv += ["--set", "workload.num_prompts=4", "-o", str(d / "run")]
        if argv[:1] == ["report"]:
            argv = ["report", str(d / "nothing")]
        o = cli(*argv)
        check_contract(o)
        no_partial_output(d, "run")
    finally:
        shutil.rmtree(d)
