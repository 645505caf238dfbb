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
])
def test_invalid_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_resolution_errors():
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        resolve_config(load_config(None, ["model.max_model_len=200000"]))
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        resolve_config(load_config(None, ["scheduler.max_num_batched_tokens=64",
                                          "scheduler.max_num_seqs=128"]))


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
