"""Hand-built RunResults for the reports tests.

Five request timelines (seconds, sent at arrival; no client-side queueing):

| id | arrival | prompt | out | first token | finish | reason   | TTFT | E2EL | TPOT      | ITLs          |
|----|---------|--------|-----|-------------|--------|----------|------|------|-----------|---------------|
| r0 | 0.0     | 100    | 4   | 0.5         | 1.1    | length   | 0.5  | 1.1  | 0.6/3=0.2 | 0.2 0.2 0.2   |
| r1 | 0.2     | 200    | 1   | 0.8         | 0.8    | stop     | 0.6  | 0.6  | (none)    |               |
| r2 | 0.5     | 50     | 3   | 1.0         | 2.5    | length   | 0.5  | 2.0  | 1.5/2=.75 | 0.5 1.0       |
| r3 | 1.0     | 300    | 2   | 1.4         | 1.7    | stop     | 0.4  | 0.7  | 0.3       | 0.3           |
| r4 | 1.2     | 5000   | 0   | -           | -      | rejected |      |      |           |               |

Engine steps end at 0.5 .7 .8 .9 1.0 1.1 1.4 1.5 1.7 2.5 s; decode tokens (not first tokens)
at .7 .9 1.1 (r0), 1.5 2.5 (r2), 1.7 (r3).
"""

from __future__ import annotations

import numpy as np
import pytest
from servesim.simulator.config import load_config
from servesim.simulator.metrics import RunResult

NAN = np.nan


def build_result(*, reasons=None, n_extra_inflight: int = 0, send=None, meta=None, **cfg_set):
    """The five-request RunResult above; ``cfg_set`` = ``{"slo.ttft_ms": 550, ...}``."""
    overrides = [f"{k.replace('__', '.')}={v}" for k, v in cfg_set.items()]
    cfg = load_config(None, overrides)
    arrival = np.array([0.0, 0.2, 0.5, 1.0, 1.2])
    first = np.array([0.5, 0.8, 1.0, 1.4, NAN])
    finish = np.array([1.1, 0.8, 2.5, 1.7, NAN])
    send = arrival.copy() if send is None else np.asarray(send, dtype=float)
    requests = {
        "request_id": np.array(["r0", "r1", "r2", "r3", "r4"], dtype=object),
        "arrival_s": arrival,
        "prompt_len": np.array([100, 200, 50, 300, 5000]),
        "output_len": np.array([4, 1, 3, 2, 0]),
        "num_cached_tokens": np.array([0, 16, 0, 32, 0]),
        "first_scheduled_s": np.array([0.0, 0.2, 0.5, 1.0, NAN]),
        "first_token_s": first,
        "finish_s": finish,
        "ttft_s": first - send,
        "tpot_s": np.array([0.2, NAN, 0.75, 0.3, NAN]),
        "e2el_s": finish - send,
        "queue_s": np.array([0.0, 0.0, 0.0, 0.0, NAN]),
        "num_preemptions": np.array([0, 0, 1, 0, 0]),
        "finished_reason": np.array(
            reasons or ["length", "stop", "length", "stop", "rejected"], dtype=object
        ),
        "send_s": send,
    }
    step_t = np.array([0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.4, 1.5, 1.7, 2.5])
    decode = np.array([0, 1, 0, 1, 0, 1, 0, 1, 1, 1])
    k = len(step_t)
    steps = {
        "time_s": step_t,
        "step_seconds": np.full(k, 0.1),
        "step_tokens": np.array([100, 1, 200, 1, 50, 1, 300, 1, 1, 1]),
        "vllm:num_requests_running": np.array([1, 2, 2, 2, 2, 2, 2, 2, 1, 0]),
        "vllm:num_requests_waiting": np.zeros(k, dtype=np.int64),
        "vllm:kv_cache_usage_perc": np.linspace(0.0, 0.45, k),
        "vllm:num_preemptions_total": np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 1]),
        "vllm:prefix_cache_queries_total": np.array([100, 100, 300, 300, 350] + [650] * 5),
        "vllm:prefix_cache_hits_total": np.array([0, 0, 16, 16, 16] + [48] * 5),
        "num_decode_reqs": decode,
        "num_prefill_tokens": np.array([100, 0, 200, 0, 50, 0, 300, 0, 0, 0]),
        # every step samples one token: a decode token or a first token (r0 .5, r1 .8,
        # r2 1.0, r3 1.4)
        "num_generated_tokens": np.ones(k, dtype=np.int64),
    }
    result = RunResult(
        config=cfg,
        requests=requests,
        itl_values=np.array([0.2, 0.5, 1.0, 0.3]),
        itl_counts=np.array([3, 1, 1, 1]),
        steps=steps,
        counters={
            "num_preemptions": 1,
            "prefix_cache_queries": 650,
            "prefix_cache_hits": 48,
            "num_steps": k,
            "num_gpu_blocks": 1234,
            "wall_seconds": 0.05,
        },
        workload_meta=meta
        if meta is not None
        else {
            "num_prompts": 5,
            "request_rate": 4.0,
            "burstiness": 1.0,
            "max_concurrency": None,
            "dataset_name": "random",
        },
    )
    return result


@pytest.fixture
def make_result():
    return build_result
