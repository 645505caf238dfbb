"""``speculative_config`` and ``lora`` values that vLLM would refuse, or that cannot be
simulated: one-line errors (exit 2) naming the key; capacity errors name what takes the
memory (the draft model, the LoRA slots), not only the target's weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from servesim.simulator.config import load_config
from servesim.simulator.errors import ConfigError
from servesim.simulator.spec_decode import check_acceptance_column

REPO = Path(__file__).resolve().parents[2]
E = str(REPO / "configs" / "llama8b_h100_eagle.yaml")
L = str(REPO / "configs" / "llama8b_h100_lora.yaml")


@pytest.mark.parametrize("config,sets,message", [
    # F7: an infinite disk latency gave a "successful" run with no timings
    (L, ["lora.disk_load_latency_ms=.inf"],
     "lora.disk_load_latency_ms: input should be a finite number (got inf)"),
    (L, ["lora.disk_load_gbps=.nan"],
     "lora.disk_load_gbps: input should be a finite number (got nan)"),
    # F12: [] ran as the default module list
    (L, ["lora.target_modules=[]"],
     ("lora.target_modules: expected at least one module name (null: vLLM's default modules) "
     "(got [])")),
    # F12: vLLM refuses these
    (E, ["speculative_config.quantization=garbage"],
     ("speculative_config.quantization: expected none, fp8, int8, int4-awq, int4-gptq or "
     "vLLM's awq, awq_marlin, gptq, gptq_marlin, auto_gptq, fp8_per_tensor, fp8_per_block, "
     "modelopt (others are not modelled) (got 'garbage')")),
    (E, ["speculative_config.method=mlp_speculator"],
     ("speculative_config.method: vLLM 0.22.1 refuses it at start-up (GPUModelRunner: "
      "\"Unknown speculative decoding method: mlp_speculator\") (got 'mlp_speculator')")),
    (E, ["speculative_config.method=ngram", "speculative_config.prompt_lookup_min=5",
         "speculative_config.prompt_lookup_max=2"],
     ("speculative_config.prompt_lookup_min: prompt_lookup_min=5 must be <= "
     "prompt_lookup_max=2 (got 5)")),
])
def test_refused_values(cli_error, config, sets, message):
    assert cli_error(config, "workload.num_prompts=30", *sets) == (
        f"error: {config} (with --set overrides): {message}")


def test_too_many_adapters_are_refused():
    """F5: 2e9 adapters allocated two 16 GB vectors (MemoryError / the OOM killer); checked on
    the config alone, so that a regression fails here without allocating them."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["lora.enable_lora=true", "lora.adapters=2000000000"])
    assert str(e.value) == ("<defaults> (with --set overrides): lora.adapters: input should be "
                            "less than or equal to 1000000 (got 2000000000)")


def test_accepted_neighbours():
    c = load_config(None, ["lora.enable_lora=true", "lora.adapters=1000000",
                           "lora.target_modules=[qkv_proj]"])
    assert c.lora.adapters == 1_000_000 and c.lora.target_modules == ["qkv_proj"]
    s = load_config(None, [("speculative_config={method: ngram, num_speculative_tokens: 2, "
                           "prompt_lookup_min: 2, prompt_lookup_max: 2, quantization: awq, "
                           "acceptance: {rate: 0.5}}")]).speculative_config
    assert (s.prompt_lookup_min, s.quantization) == (2, "awq")


# F13: the memory that does not fit is the draft model's / the LoRA slots'
def test_a_draft_model_too_large_is_named(cli_error):
    line = cli_error(E, "workload.num_prompts=30", "speculative_config.method=draft_model",
                     "speculative_config.model=llama-3.1-70b")
    assert line == (
        f"error: {E}: llama-3.1-8b on h100-sxm (tensor_parallel_size=1, pipeline_parallel_size"
        "=1): model weights take 146.44 GiB per GPU (14.99 GiB model + 131.45 GiB "
        "speculative_config.model llama-3.1-70b) but only 72.78 GiB available at "
        "gpu_memory_utilization=0.92 (79.11 GiB device); use a smaller "
        "speculative_config.model, or raise parallel.tensor_parallel_size, quantize the model, "
        "or use a larger GPU")


def test_lora_slots_too_large_are_named(cli_error):
    line = cli_error(L, "workload.num_prompts=30", "lora.max_loras=100000000",
                     "lora.max_cpu_loras=100000000")
    assert line == (
        f"error: {L}: llama-3.1-8b on h100-sxm (tensor_parallel_size=1, pipeline_parallel_size"
        "=1): model weights take 6640639.99 GiB per GPU (14.99 GiB model + 6640625.00 GiB "
        "LoRA slots (lora.max_loras=100000000, max_lora_rank=16)) but only 72.78 GiB "
        "available at gpu_memory_utilization=0.92 (79.11 GiB device); use fewer "
        "lora.max_loras or a lower max_lora_rank, or raise parallel.tensor_parallel_size, "
        "quantize the model, or use a larger GPU")


# F11: a misspelt acceptance.column was silently replaced by acceptance.rate
def spec_trace_config(tmp_path, column: str, **workload):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len,alpha,tenant\n0.0,200,50,0.7,a\n"
                     "1.0,200,50,,b\n")
    wl = workload or {"kind": "trace", "path": str(trace)}
    sets = [f"workload={wl}".replace("'", ""),
            (f"speculative_config={{method: ngram, num_speculative_tokens: 2, "
            f"acceptance: {{column: {column}, rate: 0.5}}}}")]
    return load_config(None, sets)


def test_acceptance_column_must_be_an_extra_column_of_the_trace(tmp_path):
    check_acceptance_column(spec_trace_config(tmp_path, "alpha"))  # (the rate: empty cells)
    trace = tmp_path / "t.csv"
    for col in ("alhpa", "prompt_len"):
        with pytest.raises(ConfigError) as e:
            check_acceptance_column(spec_trace_config(tmp_path, col))
        assert str(e.value) == (f"speculative_config.acceptance.column: {col!r} is not one of "
                                f"the trace's extra columns (alpha, tenant in {trace})")


def test_acceptance_column_needs_a_trace(tmp_path):
    cfg = spec_trace_config(tmp_path, "alpha", kind="random", num_prompts=5)
    with pytest.raises(ConfigError) as e:
        check_acceptance_column(cfg)
    assert str(e.value) == ("speculative_config.acceptance.column: 'alpha' is read from a "
                            "trace column, but workload.kind is random (use a canonical CSV "
                            "trace with that column)")


def test_a_run_checks_the_acceptance_column_before_simulating(tmp_path):
    """``run_experiment`` applies the check: a misspelt column with a rate is refused (it
    ran every request at the rate)."""
    from servesim.simulator.runner import run_experiment

    with pytest.raises(ConfigError, match="'alhpa' is not one of the trace's extra columns"):
        run_experiment(spec_trace_config(tmp_path, "alhpa"))
    run_experiment(spec_trace_config(tmp_path, "alpha"))  # the right one runs


@pytest.mark.parametrize("config,sets,message", [
    (E, ["cache.kv_offload={cpu_bytes: 4GiB}"],
     ("speculative_config: runs with cache.kv_offload (the cluster engine) do not model "
     "speculative decoding (the drafter's cost without its tokens would be wrong); leave it "
     "out")),
    (L, ["cache.kv_offload={cpu_bytes: 4GiB}"],
     ("lora.enable_lora: runs with cache.kv_offload (the cluster engine) do not model "
     "multi-LoRA; leave it off")),
    (E, ["cluster={instances: [{name: a, replicas: 2}]}"],
     ("speculative_config: cluster runs do not model speculative decoding (the drafter's cost "
     "without its tokens would be wrong); leave it out")),
])
def test_the_cluster_engine_refuses_what_it_would_drop(cli_error, config, sets, message):
    """Cluster runs and KV-offload runs (the cluster engine) scheduled without speculative
    decoding or LoRA while charging the drafter's cost and memory: refused, one line."""
    line = cli_error(config, "workload.num_prompts=5", *sets)
    assert line.endswith(message), line
    # refused when the config is resolved (simulate validate, sweeps and plans check it up
    # front), not only when it runs
    from servesim.simulator.config import resolve_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_config(load_config(config, list(sets)))
