"""Model and hardware catalogs: parameter counts, KV sizes, loading and errors."""

from __future__ import annotations

import json

import pytest
from servesim.costmodels import load_hardware_spec, load_model_spec
from servesim.costmodels.config import HardwareConfig, ModelConfig
from servesim.costmodels.specs import hardware_names, model_names
from servesim.simulator.errors import ConfigError

# Published sizes (ecosystem-formats.md §4; model cards), billions.
PUBLISHED = {
    "llama-3.1-8b": (8.03, None),
    "llama-3.1-70b": (70.6, None),
    "llama-2-7b": (6.74, None),
    "mistral-7b-v0.1": (7.24, None),
    "qwen2.5-7b": (7.62, None),
    "qwen2.5-72b": (72.7, None),
    "mixtral-8x7b": (46.7, 12.9),
    "deepseek-v3": (671.0, 37.0),
}


def spec(name: str):
    return load_model_spec(ModelConfig(name=name))


def test_catalogs_ship_the_listed_files():
    assert set(PUBLISHED) <= set(model_names())
    assert {"a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm", "h100-pcie", "h200-sxm", "b200",
            "l40s", "l4", "a10g", "mi300x"} <= set(hardware_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    total, active = PUBLISHED[name]
    s = spec(name)
    # published figures are rounded (70.6 for 70.55B); DeepSeek's "37B" is 37.55B counted
    # with the embedding: allow 1% on totals, 2% on active
    assert s.num_params / 1e9 == pytest.approx(total, rel=0.01)
    if active is not None:
        assert s.num_active_params / 1e9 == pytest.approx(active, rel=0.02)
    else:
        assert s.num_active_params == s.num_params


def test_exact_llama_8b_parameter_count():
    # 2·128256·4096 (embed + lm_head) + 32·218,112,000 (layers) + 4096 (final norm)
    assert spec("llama-3.1-8b").num_params == 8_030_261_248


@pytest.mark.parametrize("name,kv", [
    ("llama-3.1-8b", 131_072),   # 2·32·8·128·2
    ("llama-3.1-70b", 327_680),  # 2·80·8·128·2
    ("deepseek-v3", 70_272),     # 61·(512+64)·2: MLA latent
    ("llama-2-7b", 524_288),     # MHA: 2·32·32·128·2
    ("qwen2.5-7b", 57_344),      # 2·28·4·128·2
])
def test_kv_bytes_per_token(name, kv):
    assert spec(name).kv_bytes_per_token(2) == kv


def test_kv_bytes_shard_with_tp_pp_and_dtype():
    s = spec("llama-3.1-8b")
    assert s.kv_bytes_per_token(1) == 65_536  # fp8 KV halves it
    assert s.kv_bytes_per_token(2, tp=2) == 65_536
    assert s.kv_bytes_per_token(2, tp=8) == 16_384  # one KV head per rank
    assert s.kv_bytes_per_token(2, tp=16) == 16_384  # replicated KV heads (8 < 16)
    assert s.kv_bytes_per_token(2, pp=2) == 65_536
    ds = spec("deepseek-v3")
    assert ds.kv_bytes_per_token(2, tp=8) == 70_272  # MLA latent replicated across TP


def test_architecture_details():
    q = spec("qwen2.5-7b")
    assert q.qkv_bias and q.sliding_window is None  # use_sliding_window: false
    m = spec("mistral-7b-v0.1")
    assert m.sliding_window == 4096
    mx = spec("mixtral-8x7b")
    assert (mx.num_experts, mx.num_experts_per_tok, mx.num_moe_layers) == (8, 2, 32)
    ds = spec("deepseek-v3")
    assert ds.is_mla and ds.num_moe_layers == 58 and ds.num_dense_layers == 3
    assert ds.shared_expert_intermediate_size == 2048
    assert ds.quant_method == "fp8"
    assert spec("llama-3.1-8b").head_dim == 128


def test_real_config_json_path_and_text_config_merge(tmp_path):
    cfg = {"architectures": ["Foo"], "model_type": "foo_vl", "torch_dtype": "bfloat16",
           "text_config": {"hidden_size": 1024, "intermediate_size": 4096,
                           "num_attention_heads": 16, "num_key_value_heads": 4,
                           "num_hidden_layers": 4, "vocab_size": 1000,
                           "max_position_embeddings": 8192, "tie_word_embeddings": True}}
    d = tmp_path / "foo"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    s = load_model_spec(ModelConfig(name=str(d / "config.json")))
    assert (s.hidden_size, s.head_dim, s.num_key_value_heads) == (1024, 64, 4)
    assert s.lm_head_params == 0  # tied
    assert load_model_spec(ModelConfig(name=str(d))).name == "foo"  # a directory works too


def test_model_errors_are_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"model.name: unknown model 'nope'"):
        spec("nope")
    with pytest.raises(ConfigError, match="no such model config file"):
        spec(str(tmp_path / "missing.json"))
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 4096,')
    with pytest.raises(ConfigError, match=r"config.json:1:\d+: invalid JSON") as e:
        spec(str(bad))
    assert "\n" not in str(e.value)
    bad.write_text('{"hidden_size": 4096}')
    with pytest.raises(ConfigError, match="missing num_attention_heads"):
        spec(str(bad))


def test_hardware_specs_and_overrides():
    a = load_hardware_spec(HardwareConfig(name="a100-sxm4-80gb"))
    assert a.bf16_tflops == 312 and a.mem_bw == 2039e9 and a.fp8_tflops is None
    assert 79 < a.memory_gib < 80  # as the device reports it, not 80 GB
    assert a.memory_bytes == int(a.memory_gib * 2**30)
    assert a.source["memory_gib"]  # every file carries source notes
    h = load_hardware_spec(HardwareConfig(name="h100-sxm", mem_bw_gbps=3000))
    assert h.mem_bw_gbps == 3000 and h.bf16_tflops == 989.4
    assert "inline" in h.source["mem_bw_gbps"]
    for name in hardware_names():
        s = load_hardware_spec(HardwareConfig(name=name))
        assert s.name == name and s.bf16_tflops > 0 and s.memory_gib > 0 and s.source


def test_fully_inline_hardware_and_missing_field():
    s = load_hardware_spec(HardwareConfig(name="my-gpu", bf16_tflops=100, memory_gib=32,
                                          mem_bw_gbps=1000))
    assert s.name == "my-gpu" and s.file is None
    with pytest.raises(ConfigError, match=r"^hardware\.mem_bw_gbps: required") as e:
        load_hardware_spec(HardwareConfig(name="my-gpu", bf16_tflops=100, memory_gib=32))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("given", "canonical"), [
    ("awq", "int4-awq"), ("awq_marlin", "int4-awq"), ("gptq", "int4-gptq"),
    ("gptq_marlin", "int4-gptq"), ("auto_gptq", "int4-gptq"), ("fp8_per_tensor", "fp8"),
    ("fp8_per_block", "fp8"), ("modelopt", "fp8"), (None, "none"),
    ("int4-awq", "int4-awq")])
def test_vllm_quantization_names_are_aliases(given, canonical):
    """vLLM 0.22.1 ``--quantization`` names map to the weight format they run."""
    assert ModelConfig(quantization=given).quantization == canonical


def test_unknown_quantization_names_the_key_and_choices():
    from servesim.simulator.config import validate_tree

    for name in ("gguf", "fbgemm_fp8"):  # (fbgemm_fp8: deprecated, refused by vLLM 0.22.1)
        with pytest.raises(ConfigError, match=r"model\.quantization: .*int4-gptq") as e:
            validate_tree({"model": {"quantization": name}}, "x.yaml")
        assert "\n" not in str(e.value)


def test_quantization_must_match_a_quantized_checkpoint(tmp_path):
    """vLLM ``_verify_quantization``: awq on a GPTQ checkpoint is refused with vLLM's message;
    the checkpoint's own family (gptq_marlin) and any format on an unquantized checkpoint (a
    what-if) are taken."""
    from servesim.simulator.config import load_config, resolve_config

    path = _ckpt(tmp_path, {"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(ConfigError, match=r"model.quantization: Quantization method specified "
                       r"in the model config \(gptq\) does not match the quantization method "
                       r"specified in the `quantization` argument \(int4-awq\)"):
        resolve_config(load_config(None, [f"model.name={path}", "model.quantization=awq"]))
    for q in ("gptq_marlin", "none"):
        cfg = resolve_config(load_config(None, [f"model.name={path}", f"model.quantization={q}"]))
        assert cfg.model.quantization in ("int4-gptq", "none")
    resolve_config(load_config(None, ["model.quantization=awq"]))  # Llama-3.1-8B: bf16


def _ckpt(tmp_path, qc: dict):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "torch_dtype": "float16", "hidden_size": 1024, "intermediate_size": 4096,
           "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 4,
           "vocab_size": 1000, "max_position_embeddings": 8192, "quantization_config": qc}
    p = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_wna16_bytes_from_the_checkpoint_bits_and_group(tmp_path):
    """AWQ/GPTQ weights cost bits/8 + 2/group bytes (fp16 scale per group), bits and group size
    from quantization_config; an 8-bit GPTQ checkpoint is weight-only W8A16 (it was taken as
    W8A8 int8 at the int8 tensor rate); group -1 is one scale per row of hidden_size."""
    from servesim.costmodels.quant import resolve_weight_format

    hw = load_hardware_spec(HardwareConfig(name="h100-sxm"))
    cases = [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "none",
         ("int8-gptq", 1 + 2 / 128, "bf16")),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "gptq_marlin",
         ("int4-gptq", 0.5 + 2 / 32, "bf16")),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "none",
         ("int4-gptq", 0.5 + 2 / 1024, "bf16")),
        ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True}, "awq",
         ("int4-awq", 0.5 + 2 / 64, "bf16")),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128}, "none",
         ("int4-awq", 0.5 + 2 / 128, "bf16")),
    ]
    for qc, q, want in cases:
        path = _ckpt(tmp_path, qc)
        mc = ModelConfig(name=path, quantization=q)
        wf = resolve_weight_format(mc, load_model_spec(mc), hw)
        assert (wf.name, wf.bytes_per_param, wf.compute) == pytest.approx(want), qc
    # without a WNA16 checkpoint, the requested format's defaults: 4 bits, group 128
    mc = ModelConfig(name="llama-3.1-8b", quantization="gptq")
    wf = resolve_weight_format(mc, load_model_spec(mc), hw)
    assert (wf.name, wf.bytes_per_param) == ("int4-gptq", 0.5 + 2 / 128)
