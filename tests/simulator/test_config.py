"""Config parsing: valid, invalid, overrides, HF config.json drop-in, resolution."""

import json

import pytest
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.errors import ConfigError


def test_defaults_resolve_like_vllm():
    cfg = resolve_config(load_config(None))
    assert cfg.model.max_model_len == 131072  # Llama-3.1-8B max_position_embeddings
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (256, 2048)
    h100 = resolve_config(load_config(None, ["hardware.name=h100-sxm"]))
    assert (h100.scheduler.max_num_seqs, h100.scheduler.max_num_batched_tokens) == (1024, 8192)
    l40s = resolve_config(load_config(None, ["hardware.name=l40s"]))
    assert l40s.scheduler.max_num_seqs == 256  # < 70 GiB


def test_overrides_are_typed_by_schema():
    cfg = load_config(None, ["scheduler.max_num_seqs=128", "workload.request_rate=inf",
                             "cache.enable_prefix_caching=false", "slo.ttft_ms=1e3"])
    assert cfg.scheduler.max_num_seqs == 128
    assert cfg.workload.request_rate == float("inf")
    assert cfg.cache.enable_prefix_caching is False
    assert cfg.slo.ttft_ms == 1000.0


def test_switching_workload_kind_by_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("workload: {kind: random, num_prompts: 5, input_len: 10, seed: 3}\n")
    cfg = load_config(f, ["workload.kind=trace", "workload.path=x.csv"])
    assert cfg.workload.kind == "trace" and cfg.workload.seed == 3


@pytest.mark.parametrize("override,needle", [
    ("scheduler.max_num_seqs=abc", "scheduler.max_num_seqs"),
    ("scheduler.max_num_sqs=3", "scheduler.max_num_sqs: unknown key"),
    ("cache.gpu_memory_utilization=1.5", "cache.gpu_memory_utilization"),
    ("workload.request_rate=0", "workload.request_rate"),
    ("nonsense", "expected section.key=value"),
    ("model.dtype=float32", "model.dtype: float32 weights and activations"),
    # a misspelt key inside a section with required fields: the unknown key is named, not
    # the field it left missing
    ("cache.kv_offload={bogus: 1}", "cache.kv_offload.bogus: unknown key"),
    # vllm bench's percentile options: a typo silently dropped a metric, junk crashed after
    # the simulation
    ("output.percentile_metrics=ttft,,foo",
     "output.percentile_metrics: expected a comma list of ttft, tpot, itl, e2el"),
    ("output.percentile_metrics=TTFT", "output.percentile_metrics: expected a comma list"),
    ("output.metric_percentiles=101",
     "output.metric_percentiles: expected a comma list of percentiles from 0 to 100"),
    ("output.metric_percentiles=nan", "output.metric_percentiles: expected a comma list"),
    ("output.metric_percentiles=50,,abc", "output.metric_percentiles: expected a comma list"),
    ("output.timeseries_interval_s=1e-300",
     "output.timeseries_interval_s: input should be greater than or equal to 0.000001"),
    ("output.timeseries_interval_s=.inf",
     "output.timeseries_interval_s: input should be less than or equal to 100000000"),
    ("client.max_retries=1000000000",
     "client.max_retries: input should be less than or equal to 100"),
])
def test_invalid_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_vllm_dtype_spellings():
    """vLLM's ``--dtype half`` is float16."""
    assert load_config(None, ["model.dtype=half"]).model.dtype == "float16"


def test_resolution_errors():
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        resolve_config(load_config(None, ["model.max_model_len=200000"]))
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        resolve_config(load_config(None, ["scheduler.max_num_batched_tokens=64",
                                          "scheduler.max_num_seqs=128"]))


@pytest.mark.parametrize("fields, derived, default", [
    # plain: max_position_embeddings
    ({"max_position_embeddings": 32768}, 32768, 32768),
    # YaRN (Qwen2.5's long-context recipe): original_max_position_embeddings × factor
    ({"max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     131072, 131072),
    # linear scaling: × factor; the same under transformers v5's rope_parameters
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}},
     8192, 8192),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "linear",
                                                           "factor": 2.0}}, 8192, 8192),
    # llama3 / longrope lengths are already scaled; LongRoPE defaults to the original length
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3",
                                                          "factor": 8.0}}, 131072, 131072),
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, 131072, 4096),
    # Gemma 3's length is already scaled
    ({"model_type": "gemma3_text", "max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, 131072, 131072),
    # the smallest length key wins; none at all: 2048
    ({"max_position_embeddings": 4096, "seq_length": 2048}, 2048, 2048),
    ({"n_positions": 1024}, 1024, 1024),
    ({}, 2048, 2048),
    # legacy "su" is LongRoPE; YaRN may give its original length at the top level
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "su", "short_factor": [1.0]}}, 131072, 4096),
    ({"max_position_embeddings": 32768, "original_max_position_embeddings": 8192,
      "rope_scaling": {"type": "yarn", "factor": 2.0}}, 16384, 16384),
])
def test_derived_max_model_len_as_vllm(fields, derived, default):
    """vLLM 0.22.1 ``_get_and_verify_max_len`` (``model_arch_config_convertor``'s length
    keys): the length a config.json allows and the one an unset max_model_len takes."""
    from servesim.costmodels.specs import derive_max_len

    lim = derive_max_len(fields)
    assert (lim.derived, lim.default) == (derived, default)


@pytest.mark.parametrize("fields, says", [
    ({"model_max_length": float("inf")}, "model_max_length must be a positive whole number"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive whole number"),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": -2}},
     "rope_scaling.factor must be a positive number"),
    ({"max_position_embeddings": 4096, "rope_scaling": {
        "type": "yarn", "factor": 4, "original_max_position_embeddings": "4096"}},
     "original_max_position_embeddings must be a positive whole number, got '4096'"),
])
def test_derived_max_len_refuses_odd_config_values(fields, says):
    from servesim.costmodels.specs import derive_max_len

    with pytest.raises(ConfigError, match=says):
        derive_max_len(fields, "x/config.json")


def test_yarn_config_json_allows_its_scaled_length(tmp_path):
    """A drop-in config.json with YaRN scaling: max_model_len defaults to, and may be set up
    to, 4 × 32,768; beyond, vLLM's refusal; model_max_length widens what may be set."""
    hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
          "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
          "num_hidden_layers": 24, "vocab_size": 151936, "max_position_embeddings": 32768,
          "rope_scaling": {"type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 32768}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert resolve_config(load_config(None, [f"model.name={path}"])).model.max_model_len == \
        131072
    with pytest.raises(ConfigError, match=r"User-specified max_model_len \(131073\) is greater "
                       r"than the derived max_model_len \(max_position_embeddings=131072"):
        resolve_config(load_config(None, [f"model.name={path}", "model.max_model_len=131073"]))
    path.write_text(json.dumps({**hf, "rope_scaling": None, "model_max_length": 65536}))
    # a config's model_max_length, when set, is the length (vLLM's rule for Command-R)
    c = resolve_config(load_config(None, [f"model.name={path}", "model.max_model_len=40000"]))
    assert c.model.max_model_len == 40000
    assert resolve_config(load_config(None, [f"model.name={path}"])).model.max_model_len == \
        65536


def test_hf_config_json_drop_in(tmp_path):
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 16, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    cfg = resolve_config(load_config(None, [f"model.name={path}"]))
    from servesim.costmodels import load_model_spec
    spec = load_model_spec(cfg.model)
    assert spec.num_hidden_layers == 16 and spec.head_dim == 64
    # a nested text_config (multimodal models) is merged up
    path.write_text(json.dumps({"architectures": ["X"], "text_config": hf}))
    assert load_model_spec(cfg.model).hidden_size == 2048


def test_moe_with_data_parallel_warns_that_vllm_shards_experts_over_dp():
    """vLLM (FusedMoEParallelConfig.make) shards a MoE model's experts over DP x TP GPUs and
    steps DP ranks in lockstep; servesim's independent DP engines only approximate it: said
    once, naming the sizes. Dense models at DP 2 and MoE models at DP 1 are silent."""
    import warnings
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def caught(path, *ov):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            resolve_config(load_config(path, list(ov)))
        return [str(x.message) for x in w if "mixture-of-experts" in str(x.message)]

    mixtral = root / "configs" / "mixtral_h100_tp2.yaml"
    msgs = caught(mixtral, "parallel.data_parallel_size=2")
    assert len(msgs) == 1 and msgs[0].startswith(
        "mixtral-8x7b is a mixture-of-experts model: at data_parallel_size 2 vLLM shards its "
        "experts over all DP x TP = 4 GPUs and steps the DP ranks in lockstep")
    assert caught(mixtral) == []
    assert caught(root / "configs" / "llama8b_a100.yaml", "parallel.data_parallel_size=2") == []


def test_percentile_options_take_vllm_spellings_and_yaml_numbers():
    """``--metric-percentiles 99`` from YAML is a number (it was refused as not a string);
    lists and spaces are taken and written as vLLM's comma list."""
    out = load_config(None, ["output.metric_percentiles=99",
                             "output.percentile_metrics=ttft, tpot"]).output
    assert (out.metric_percentiles, out.percentile_metrics) == ("99", "ttft,tpot")
    out = load_config(None, ["output.metric_percentiles=[50, 99.9, 0, 100]"]).output
    assert out.metric_percentiles == "50,99.9,0,100"
