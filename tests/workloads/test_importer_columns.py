"""Every importer's column mapping and units, on small fixtures written here: which column
becomes ``prompt_len`` / ``output_len`` / ``arrival_s`` (and in which unit), what is shifted,
rescaled, filtered or kept. Complements test_importers.py (detection, errors, real traces)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from servesim.workloads import build_workload
from servesim.workloads.config import TraceWorkload
from servesim.workloads.generators import MOONCAKE_BASE
from servesim.workloads.importers import read_trace


def reqs(path, **kw):
    return list(build_workload(TraceWorkload(path=str(path), **kw), block_size=16))


def triples(rs):
    return [(r.arrival_s, r.prompt_len, r.output_len) for r in rs]


def test_azure2023_stamps_to_seconds(write):
    """TIMESTAMP (naive, 7 fractional digits: µs kept) → s after the first row;
    ContextTokens → prompt, GeneratedTokens → output."""
    p = write("az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                        "2023-11-16 18:15:46.6805900,374,44\n"
                        "2023-11-16 18:15:46.6805910,5,6\n"
                        "2023-11-16 18:16:47.1805900,7,8\n"
                        "2023-11-17 18:15:46.6805900,9,10\n")
    raw = list(read_trace(p))
    assert [r.arrival_s for r in raw] == [0.0, 1e-6, 60.5, 86400.0]
    assert [(r.prompt_len, r.output_len) for r in raw] == [(374, 44), (5, 6), (7, 8), (9, 10)]
    assert triples(reqs(p)) == triples(raw)  # already starts at 0


def test_azure2024_timezone_stamps(write):
    p = write("az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                        "2024-05-10 23:59:59.500000+00:00,2162,5\n"
                        "2024-05-11 01:59:59.750000+02:00,1452,3\n")  # 0.25 s later (UTC)
    assert triples(read_trace(p)) == [(0.0, 2162, 5), (0.25, 1452, 3)]


def test_burstgpt_columns_by_name_seconds_and_failed_rows(write):
    """Columns are found by name (any order, extras ignored); Timestamp in s, shifted to 0;
    Response tokens 0 = failed: dropped, or kept as 1 token with keep_failed."""
    p = write("b.csv", "Log Type,Response tokens,Extra,Request tokens,Timestamp,Model\n"
                       "API log,7,x,11,100.25,ChatGPT\n"
                       "API log,0,x,12,101.5,GPT-4\n"
                       "Conversation log,9,x,13,103.0,GPT-4\n")
    assert triples(reqs(p)) == [(0.0, 11, 7), (2.75, 13, 9)]
    assert triples(reqs(p, keep_failed=True)) == [(0.0, 11, 7), (1.25, 12, 1), (2.75, 13, 9)]
    assert triples(reqs(p, model="GPT-4", keep_failed=True)) == [(0.0, 12, 1), (1.5, 13, 9)]


def test_mooncake_milliseconds_and_block_ids(write):
    """timestamp in ms; input_length / output_length; hash_ids name 512-token blocks: engine
    block i gets MOONCAKE_BASE + h·512 + ((i+1)·bs − 1) mod 512 for the hash h holding its
    last token."""
    p = write("m.jsonl", "\n".join(json.dumps(r) for r in [
        {"timestamp": 1500.5, "input_length": 40, "output_length": 3, "hash_ids": [7]},
        {"timestamp": 2000, "input_length": 530, "output_length": 4, "hash_ids": [7, 9]},
        {"timestamp": 2250, "input_length": 10, "output_length": 5, "hash_ids": [3]},
    ]))
    rs = reqs(p)
    assert [r.arrival_s for r in rs] == [0.0, pytest.approx(0.4995), pytest.approx(0.7495)]
    assert [(r.prompt_len, r.output_len) for r in rs] == [(40, 3), (530, 4), (10, 5)]
    assert rs[0].prefix_block_ids == (MOONCAKE_BASE + 7 * 512 + 15,
                                      MOONCAKE_BASE + 7 * 512 + 31)
    b = rs[1].prefix_block_ids
    assert len(b) == 530 // 16 and b[:2] == rs[0].prefix_block_ids
    assert b[31] == MOONCAKE_BASE + 7 * 512 + 511  # block 31 ends at token 511: hash 7
    assert b[32] == MOONCAKE_BASE + 9 * 512 + 15  # block 32: tokens 512..527, hash 9
    assert rs[2].prefix_block_ids is None  # no full block


def test_vidur_seconds_shifted(write):
    p = write("v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n"
                       "2.5,100,10\n3.0,200,20\n10.5,300,30\n")
    assert triples(read_trace(p)) == [(2.5, 100, 10), (3.0, 200, 20), (10.5, 300, 30)]
    assert triples(reqs(p)) == [(0.0, 100, 10), (0.5, 200, 20), (8.0, 300, 30)]


def test_canonical_optional_columns_and_rescaling(write):
    p = write("c.csv", "output_len,arrival_s,prompt_len,priority,think_time_s,lora\n"
                       "5,1.0,10,2,0.5,x\n6,2.0,20,,,\n7,5.0,30,-1,,\n")
    rs = reqs(p)
    assert triples(rs) == [(0.0, 10, 5), (1.0, 20, 6), (4.0, 30, 7)]
    assert [r.priority for r in rs] == [2, 0, -1]
    assert (rs[0].think_time_s, rs[0].lora, rs[1].lora) == (0.5, "x", None)
    # time_scale multiplies; request_rate rescales to (N − 1)/(last − first) = the rate
    assert [r.arrival_s for r in reqs(p, time_scale=2.0)] == [0.0, 2.0, 8.0]
    scaled = reqs(p, request_rate=1.0)  # measured mean rate 2/4 = 0.5/s → ×0.5
    assert [r.arrival_s for r in scaled] == [0.0, 0.5, 2.0]


def test_vllm_result_lengths_start_times_and_failures(write):
    """input_lens → prompt, output_lens → output, start_times (s) → arrival (sorted, shifted);
    a request with an error (or no output) is dropped, or kept as ≥ 1 token."""
    d = {"input_lens": [11, 22, 33], "output_lens": [4, 0, 6],
         "start_times": [100.5, 100.0, 101.25], "errors": ["", "", "timeout"]}
    p = write("r.json", json.dumps(d))
    rs = reqs(p)
    assert triples(rs) == [(0.0, 11, 4)]  # request 1: 0 tokens (failed); 2: error
    assert [r.request_id for r in rs] == ["0"]
    kept = reqs(p, keep_failed=True)
    assert triples(kept) == [(0.0, 22, 1), (0.5, 11, 4), (1.25, 33, 6)]
    assert [r.request_id for r in kept] == ["1", "0", "2"]


def test_sharegpt_character_count_shuffle_and_overrides(write):
    """No tokenizer: ceil(characters / 4) tokens; vLLM's shuffle (random.seed(seed)); no
    timestamps (vLLM's Gamma arrivals at request_rate); sharegpt_output_len overrides."""
    convs = [{"id": str(i), "conversations": [{"value": "a" * (16 + i)},
                                              {"value": "b" * (8 * (i + 2))}]}
             for i in range(6)]
    p = write("s.json", json.dumps(convs))
    order = list(range(6))
    random.Random(5).shuffle(order)
    rs = reqs(p, seed=5)
    want = [(-(-(16 + i) // 4), 2 * (i + 2)) for i in order]
    assert [(r.prompt_len, r.output_len) for r in rs] == want
    assert all(r.arrival_s == 0 for r in rs)
    o = reqs(p, seed=5, sharegpt_output_len=3)
    assert [r.output_len for r in o] == [3] * 6  # < 4 allowed when overridden
    t = [r.arrival_s for r in reqs(p, seed=5, request_rate=2.0)]
    assert t[-1] == pytest.approx(6 / 2.0) and np.all(np.diff(t) >= 0)
