"""Importers: every format, auto-detection, bad rows, real traces (when present)."""

import json

import numpy as np
import pytest
from conftest import SHARED_TRACES
from servesim.simulator.errors import TraceError
from servesim.workloads import build_workload
from servesim.workloads.config import TraceWorkload
from servesim.workloads.importers import detect_format, read_trace
from servesim.workloads.importers_json import mooncake_block_ids

AZURE23 = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
    "2023-11-16 18:15:51.0000000,20,1\n"
)
AZURE24 = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2024-05-10 00:00:00.009930+00:00,2162,5\n"
    "2024-05-10 00:00:01.509930+00:00,1452,3\n"
)
BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,10,2,12,Conversation log\n"
    "6,GPT-4,100,0,100,Conversation log\n"
    "7.5,GPT-4,300,20,320,API log\n"
    "9,ChatGPT,40,8,48,API log\n"
)
MOONCAKE = "\n".join(json.dumps(r) for r in [
    {"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 1000, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 3]},
    {"timestamp": 4000, "input_length": 600, "output_length": 9, "hash_ids": [0, 4]},
]) + "\n"
VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.314579,396,109\n"
CANONICAL = (
    "arrival_s,prompt_len,output_len,prefix_block_ids,priority,session_id,turn,lora,parent_id,"
    "think_time_s,request_id\n"
    "0.5,40,8,1 2,0,s1,0,,,,a\n"
    "1.5,60,8,1 2 3,1,s1,1,my-lora,a,2.5,b\n"
    "2.0,10,3,,0,,0,,,,c\n"
)
VLLM_RESULT = {
    "num_prompts": 4, "request_rate": 2.0, "burstiness": 1.0,
    "input_lens": [100, 200, 300, 400], "output_lens": [10, 0, 30, 40],
    "start_times": [10.0, 10.5, 12.0, 11.0], "errors": ["", "boom", "", ""],
    "ttfts": [0.1, 0.0, 0.2, 0.3],
}
SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "x" * 40},
                                  {"from": "gpt", "value": "y" * 80}]},
    {"id": "b", "conversations": [{"from": "human", "value": "hi"}]},  # < 2 turns
    {"id": "c", "conversations": [{"from": "human", "value": "abc"},
                                  {"from": "gpt", "value": "z" * 100}]},  # prompt < 4 tokens
    {"id": "d", "conversations": [{"from": "human", "value": "q" * 400},
                                  {"from": "gpt", "value": "r" * 400}]},
]


def reqs(path, **kw):
    return list(build_workload(TraceWorkload(path=str(path), **kw), block_size=16))


@pytest.mark.parametrize("name,text,fmt", [
    ("a.csv", AZURE23, "azure2023"), ("b.csv", AZURE24, "azure2024"),
    ("c.csv", BURSTGPT, "burstgpt"), ("d.jsonl", MOONCAKE, "mooncake"),
    ("e.csv", VIDUR, "vidur"), ("f.csv", CANONICAL, "canonical"),
    ("g.json", json.dumps(VLLM_RESULT, indent=2), "vllm_result"),
    ("h.json", json.dumps(SHAREGPT), "sharegpt"),
])
def test_detect_format(write, name, text, fmt):
    assert detect_format(write(name, text)) == fmt


def test_azure_2023_and_2024(write):
    r = reqs(write("a.csv", AZURE23))
    assert [x.prompt_len for x in r] == [374, 396, 20]
    assert [x.output_len for x in r] == [44, 109, 1]
    assert r[0].arrival_s == 0.0
    assert r[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    r = reqs(write("b.csv", AZURE24))
    assert [x.arrival_s for x in r] == [0.0, 1.5]


def test_burstgpt_filters(write):
    p = write("c.csv", BURSTGPT)
    wl = build_workload(TraceWorkload(path=str(p)), block_size=16)
    r = list(wl)
    assert [x.prompt_len for x in r] == [10, 300, 40] and wl.meta["dropped_failed"] == 1
    assert [x.arrival_s for x in r] == [0.0, 2.5, 4.0]
    assert len(reqs(p, keep_failed=True)) == 4
    r = reqs(p, model="GPT-4")
    assert [x.prompt_len for x in r] == [300]
    assert [x.prompt_len for x in reqs(p, log_type="API log")] == [300, 40]


def test_mooncake_prefix_ids(write):
    r = reqs(write("d.jsonl", MOONCAKE))
    assert [x.arrival_s for x in r] == [0.0, 0.0, 3.0]
    a, b, c = (x.prefix_block_ids for x in r)
    assert len(a) == 1100 // 16 and len(b) == 1500 // 16 and len(c) == 600 // 16
    # two equal leading hash ids ⇒ exactly 2·512 tokens = 64 blocks of 16 shared
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common == 64 and common * 16 == 2 * 512
    # one equal leading id ⇒ 32 blocks
    assert next(i for i, (x, y) in enumerate(zip(a, c)) if x != y) == 32
    assert len(set(a)) == len(a)


@pytest.mark.parametrize("bs", [16, 32, 64, 128, 512, 1024])
def test_mooncake_ids_any_block_size(bs):
    a = mooncake_block_ids([0, 1, 2, 3], 2000, bs)
    b = mooncake_block_ids([0, 1, 9, 10], 2000, bs)
    shared = 2 * 512 // bs
    assert a[:shared] == b[:shared] and len(a) == 2000 // bs
    assert shared == len(a) or a[shared] != b[shared]


def test_vidur_and_canonical(write):
    r = reqs(write("e.csv", VIDUR))
    assert [(x.arrival_s, x.prompt_len, x.output_len) for x in r] == [(0.0, 374, 44),
                                                                     (4.314579, 396, 109)]
    r = reqs(write("f.csv", CANONICAL))
    assert r[0].arrival_s == 0.0 and r[1].arrival_s == 1.0
    assert r[1].prefix_block_ids == (1, 2, 3) and r[2].prefix_block_ids is None
    assert (r[1].priority, r[1].session_id, r[1].turn, r[1].lora) == (1, "s1", 1, "my-lora")
    assert (r[1].parent_id, r[1].think_time_s, r[1].request_id) == ("a", 2.5, "b")


def test_vllm_result_replay(write):
    p = write("g.json", json.dumps(VLLM_RESULT))
    wl = build_workload(TraceWorkload(path=str(p)), block_size=16)
    r = list(wl)
    # sorted by start time, failed request dropped
    assert [x.prompt_len for x in r] == [100, 400, 300]
    assert [x.arrival_s for x in r] == [0.0, 1.0, 2.0]
    assert wl.meta["dropped_failed"] == 1
    # no start_times: vLLM get_request arrivals at the requested rate
    d = {k: v for k, v in VLLM_RESULT.items() if k != "start_times"}
    p2 = write("g2.json", json.dumps(d))
    r = reqs(p2, request_rate=2.0)
    assert [x.prompt_len for x in r] == [100, 300, 400]
    assert r[-1].arrival_s == pytest.approx(3 / 2.0)


def test_sharegpt(write):
    p = write("h.json", json.dumps(SHAREGPT))
    wl = build_workload(TraceWorkload(path=str(p)), block_size=16)
    r = list(wl)
    assert sorted((x.prompt_len, x.output_len) for x in r) == [(10, 20), (100, 100)]
    # filtered: "c" (prompt < 4 tokens) and "b" (< 2 turns, dropped as vLLM does)
    assert wl.meta["filtered"] == 2 and all(x.arrival_s == 0 for x in r)
    assert wl.meta["timestamps"] == "generated"
    assert len(reqs(p, sharegpt_filter=False)) == 3
    pre = [{"prompt_len": 50, "output_len": 9}, {"prompt_len": 2000, "output_len": 9}]
    r = reqs(write("pre.json", json.dumps(pre)), format="sharegpt", request_rate=1.0)
    assert [(x.prompt_len, x.output_len) for x in r] == [(50, 9)]
    assert r[0].arrival_s == pytest.approx(1.0)


@pytest.mark.parametrize("text,msg", [
    (AZURE23.replace("396,109", "x,109"),
     "a.csv:3: expected an integer ContextTokens, got 'x'"),
    (AZURE23.replace(",396,109", ",396"), "a.csv:3: expected 3 fields"),
    (AZURE23.replace("396,109", "396,-2"), "a.csv:3: negative output length -2"),
    (AZURE23.replace("2023-11-16 18:15:50.9951690", "yesterday"),
     "a.csv:3: expected a TIMESTAMP like"),
    (AZURE23.replace("18:15:51.0000000", "18:15:40.0000000"), "a.csv:4: timestamp goes back"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "a.csv: empty trace"),
    ("", "a.csv: empty trace"),
    ("foo,bar\n1,2\n", "a.csv:1: cannot detect the trace format"),
])
def test_bad_rows(write, text, msg):
    p = write("a.csv", text)
    with pytest.raises(TraceError, match=None) as e:
        reqs(p)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_skip_bad_rows(write):
    bad = AZURE23.replace("396,109", "x,109").replace("20,1", "20,-1")
    p = write("a.csv", bad)
    wl = build_workload(TraceWorkload(path=str(p), skip_bad_rows=True), block_size=16)
    assert len(list(wl)) == 1 and wl.meta["skipped_bad_rows"] == 2


def test_bad_jsonl_and_missing_file(write, tmp_path):
    p = write("m.jsonl", MOONCAKE.replace('"input_length": 1500', '"input_len": 1500'))
    with pytest.raises(TraceError, match=r"m.jsonl:2: expected key 'input_length'"):
        reqs(p, format="mooncake")
    p = write("m2.jsonl", MOONCAKE + "{not json\n")
    with pytest.raises(TraceError, match=r"m2.jsonl:4: expected a JSON object"):
        reqs(p)
    with pytest.raises(TraceError, match=r"nope.csv: no such file"):
        build_workload(TraceWorkload(path=str(tmp_path / "nope.csv")), block_size=16)


def test_canonical_block_size_mismatch(write):
    p = write("f.csv", "arrival_s,prompt_len,output_len,prefix_block_ids\n0,32,0,1 2 3\n")
    with pytest.raises(TraceError, match="f.csv:2: 3 prefix_block_ids but only 2 full blocks"):
        reqs(p)


def test_transforms(write):
    rows = "".join(f"{t},{100 + t},{10}\n" for t in range(0, 100, 2))  # 50 rows, 2 s apart
    p = write("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n" + rows)
    r = reqs(p, start_s=10, end_s=20)
    assert [x.prompt_len for x in r] == [110, 112, 114, 116, 118]
    assert r[0].arrival_s == 0.0
    assert len(reqs(p, max_requests=7)) == 7
    r = reqs(p, time_scale=0.5)
    assert r[-1].arrival_s == 49.0
    wl = build_workload(TraceWorkload(path=str(p), request_rate=2.0), block_size=16)
    r = list(wl)
    assert r[-1].arrival_s == pytest.approx(49 / 2.0) and wl.meta["num_prompts"] == 50
    s1 = [x.prompt_len for x in reqs(p, sample=10, seed=1)]
    assert len(s1) == 10 and s1 == sorted(s1) and s1 == [x.prompt_len
                                                         for x in reqs(p, sample=10, seed=1)]
    assert s1 != [x.prompt_len for x in reqs(p, sample=10, seed=2)]
    wl = build_workload(TraceWorkload(path=str(p)), block_size=16)
    list(wl)
    assert wl.meta["request_rate"] == pytest.approx(0.5) and wl.meta["num_prompts"] == 50


def test_gzip(tmp_path):
    import gzip

    p = tmp_path / "a.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write(AZURE23)
    assert len(reqs(p)) == 3


real = pytest.mark.skipif(not SHARED_TRACES.is_dir(), reason="shared/traces not present")


# The README's 8,818 / 19,365 come from `wc -l` minus the header: the last row has no
# trailing newline, so the files really hold 8,819 and 19,366 requests (pandas agrees).
@real
@pytest.mark.parametrize("name,fmt,n,p50_prompt,p50_out", [
    ("azure2023_code.csv", "azure2023", 8819, 1469, 13),
    ("azure2023_conv.csv", "azure2023", 19366, 1020, 129),
    ("mooncake_conversation.jsonl", "mooncake", 12031, None, None),
    ("mooncake_synthetic.jsonl", "mooncake", 3993, None, None),
])
def test_real_traces(name, fmt, n, p50_prompt, p50_out):
    path = SHARED_TRACES / name
    assert detect_format(path) == fmt
    r = list(read_trace(path, block_size=16))
    assert len(r) == n
    p = np.array([x.prompt_len for x in r])
    o = np.array([x.output_len for x in r])
    t = np.array([x.arrival_s for x in r])
    assert np.all(np.diff(t) >= 0) and 900 < t[-1] - t[0] < 3700
    if p50_prompt is not None:
        assert np.median(p) == p50_prompt and np.median(o) == p50_out
    else:
        assert 1000 < np.median(p) < 100_000 and 1 <= np.median(o) < 2000
        assert all(x.prefix_block_ids is None or len(x.prefix_block_ids) == x.prompt_len // 16
                   for x in r[:200])
