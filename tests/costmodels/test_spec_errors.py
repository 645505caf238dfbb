"""Model files, hardware numbers and ``simulate estimate`` shapes that cannot be modelled:
one-line errors (exit 2) naming the file and the key, never a hang or an internal error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from cmutil import REPO
from servesim.costmodels.specs import ModelSpec, model_spec_from_hf
from servesim.simulator.cli import run_cli
from servesim.simulator.errors import ConfigError

CONFIG = str(REPO / "configs" / "llama8b_a100.yaml")
LLAMA = yaml.safe_load((REPO / "configs" / "models" / "llama-3.1-8b.yaml").read_text())


def model_file(tmp_path, **changes):
    """llama-3.1-8b's config.json with ``changes``, as a JSON file."""
    p = tmp_path / "model.json"
    p.write_text(json.dumps({**LLAMA, **changes}))  # (NaN is written as NaN, as HF does)
    return p


def cli(capsys, *args) -> tuple[int, str]:
    """(exit code, stderr) of ``simulate <args>`` run in this process."""
    rc = run_cli([str(a) for a in args])
    return rc, capsys.readouterr().err


def one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "internal error:"))]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# -- H2: a huge layer count ----------------------------------------------------------------


def test_huge_layer_count_is_refused_when_the_file_is_read(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.json: num_hidden_layers must be at most "
                                          r"10,000 \(no real model comes close\), got "
                                          r"1000000000000$"):
        model_spec_from_hf({**LLAMA, "num_hidden_layers": 10**12}, "m", str(tmp_path /
                                                                            "model.json"))


def test_validate_and_estimate_with_a_huge_layer_count_answer_at_once(tmp_path):
    m = model_file(tmp_path, num_hidden_layers=1e12)
    for cmd in (["validate", CONFIG], ["estimate", CONFIG, "--batch-size", "1", "--context",
                                       "1"]):
        p = subprocess.run([sys.executable, "-c", ("from servesim.simulator.cli import main; "
                            "main()"), *cmd, "--set", f"model.name={m}"],
                           check=False, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert one_error(p.stderr).endswith(
            f"{m}: num_hidden_layers must be at most 10,000 (no real model comes close), got "
            "1000000000000.0")


@pytest.mark.parametrize("key,value", [
    ("num_attention_heads", 20_000), ("num_key_value_heads", 20_000),
    ("hidden_size", 2_000_000), ("intermediate_size", 20_000_000), ("vocab_size", 10**9),
    ("num_local_experts", 200_000), ("n_routed_experts", 200_000),
])
def test_other_model_counts_are_bounded(tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"m\.json: {key} must be at most [0-9,]+ .*got "
                                          rf"{value}$"):
        model_spec_from_hf({**LLAMA, key: value}, "m", "m.json")


def test_moe_layer_count_does_not_loop_over_the_layers():
    """num_moe_layers / moe_layers_in are closed forms: 10^12 layers answer at once (the old
    loop over every layer ran for minutes), and they agree with is_moe_layer."""
    code = ("from servesim.costmodels.specs import ModelSpec\n"
            "s = ModelSpec('m', 'm', (), 'x', 1, 1, 10**12, 1, 1, 1, 1, 1, num_experts=8, "
            "first_k_dense_replace=3, moe_layer_freq=2)\n"
            "print(s.num_moe_layers, s.num_dense_layers)\n")
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       timeout=30)
    assert p.stdout.split() == [str(10**12 // 2 - 2), str(10**12 - (10**12 // 2 - 2))]
    for layers, first, freq in ((0, 0, 1), (7, 0, 1), (10, 3, 2), (61, 3, 1), (9, 12, 1)):
        s = ModelSpec("m", "m", (), "x", 1, 1, layers, 1, 1, 1, 1, 1, num_experts=4,
                      first_k_dense_replace=first, moe_layer_freq=freq)
        assert s.num_moe_layers == sum(s.is_moe_layer(i) for i in range(layers))
        for a in range(layers + 1):
            for b in range(a, layers + 1):
                assert s.moe_layers_in(a, b) == sum(s.is_moe_layer(i) for i in range(a, b))


# -- M9: non-finite or absurd numbers ------------------------------------------------------


@pytest.mark.parametrize("override,message", [
    ("hardware.memory_gib=inf", ("hardware.memory_gib: input should be a finite number "
                                "(got 'inf')")),
    ("hardware.memory_gib=1e308", ("hardware.memory_gib: input should be less than or equal "
                                  "to 10000 (got '1e308')")),
    ("hardware.bf16_tflops=inf", ("hardware.bf16_tflops: input should be a finite number "
                                 "(got 'inf')")),
    ("cache.kv_cache_memory_bytes=inf", ("cache.kv_cache_memory_bytes: expected a byte count "
                                        "such as 8589934592, '8G' or '8GiB' (got 'inf')")),
    ("cache.kv_cache_memory_bytes=1e400GB", ("cache.kv_cache_memory_bytes: expected a finite "
                                            "byte count (got '1e400GB')")),
])
def test_non_finite_config_numbers_are_user_errors(capsys, override, message):
    rc, err = cli(capsys, "validate", CONFIG, "--set", override)
    assert rc == 2
    assert one_error(err).endswith(message)


def test_non_finite_numbers_in_a_config_file(capsys, tmp_path):
    for section, text in (("hardware", "hardware: {name: a100-sxm4-80gb, memory_gib: .inf}"),
                          ("cache", "cache: {kv_cache_memory_bytes: .inf}")):
        cfg = tmp_path / f"{section}.yaml"
        cfg.write_text(f"model: {{name: llama-3.1-8b}}\n{text}\n")
        rc, err = cli(capsys, "validate", cfg)
        assert rc == 2
        assert one_error(err) == {
            "hardware": f"error: {cfg}: hardware.memory_gib: input should be a finite number "
                        "(got inf)",
            "cache": f"error: {cfg}: cache.kv_cache_memory_bytes: expected a finite byte count "
                     "(got inf)"}[section]


def test_non_finite_numbers_in_a_hardware_file(capsys, tmp_path):
    hw = tmp_path / "gpu.yaml"
    hw.write_text("bf16_tflops: 312\nmemory_gib: .inf\nmem_bw_gbps: 2039\n")
    rc, err = cli(capsys, "validate", CONFIG, "--set", f"hardware.name={hw}")
    assert rc == 2
    assert one_error(err).endswith(
        f"{hw}: hardware.memory_gib must be a positive finite number of at most 10,000, "
        "got inf")


def test_nan_in_a_model_file(capsys, tmp_path):
    m = model_file(tmp_path, intermediate_size=float("nan"))
    rc, err = cli(capsys, "validate", CONFIG, "--set", f"model.name={m}")
    assert rc == 2
    assert one_error(err).endswith(f"{m}: intermediate_size must be a non-negative integer, "
                                   "got nan")
    m = model_file(tmp_path, partial_rotary_factor=float("nan"))
    rc, err = cli(capsys, "validate", CONFIG, "--set", f"model.name={m}")
    assert rc == 2
    assert one_error(err).endswith(f"{m}: partial_rotary_factor must be a number in (0, 1], "
                                   "got nan")


# -- L5: head and layer counts -------------------------------------------------------------


@pytest.mark.parametrize("changes,message", [
    ({"num_key_value_heads": 7}, ("num_attention_heads (32) must be divisible by "
                                 "num_key_value_heads (7) (vLLM refuses this model)")),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be positive, got 0"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be positive, got 0"),
])
def test_impossible_head_and_layer_counts(capsys, tmp_path, changes, message):
    m = model_file(tmp_path, **changes)
    rc, err = cli(capsys, "validate", CONFIG, "--set", f"model.name={m}")
    assert rc == 2
    assert one_error(err).endswith(f"{m}: {message}")


def test_gqa_and_absent_kv_heads_still_load():
    s = model_spec_from_hf(LLAMA, "m", "m.json")
    assert (s.num_attention_heads, s.num_key_value_heads) == (32, 8)
    d = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert model_spec_from_hf(d, "m", "m.json").num_key_value_heads == 32  # MHA


# -- L4: estimate shapes -------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "99999999999999999999999", "--context", "100"],
     ("error: estimate: 99999999999999999999999 sequences (--batch-size) exceed "
     "scheduler.max_num_seqs (256); vLLM never schedules more in one step")),
    (["--batch-size", "257", "--context", "100"],
     ("error: estimate: 257 sequences (--batch-size) exceed scheduler.max_num_seqs (256); "
     "vLLM never schedules more in one step")),
    (["--batch-size", "256", "--context", "100", "--prefill-tokens", "8"],
     ("error: estimate: 257 sequences (--batch-size + the prefill) exceed "
     "scheduler.max_num_seqs (256); vLLM never schedules more in one step")),
    (["--batch-size", "8", "--context", "200000"],
     "error: estimate: --context 200000 is longer than model.max_model_len (131072)"),
    (["--batch-size", "0", "--context", "1", "--prefill-tokens", "100",
      "--prefill-context", "131000"],
     ("error: estimate: --prefill-context + --prefill-tokens (131100) is longer than "
     "model.max_model_len (131072)")),
])
def test_estimate_refuses_impossible_shapes(capsys, args, message):
    rc, err = cli(capsys, "estimate", CONFIG, *args)
    assert rc == 2
    assert one_error(err) == message


def test_estimate_refuses_a_model_that_does_not_fit(capsys):
    rc, err = cli(capsys, "estimate", CONFIG, "--batch-size", "1", "--context", "10",
                  "--set", "model.name=llama-3.1-70b", "--set", "hardware.name=l4")
    assert rc == 2
    line = one_error(err)
    assert line.startswith(f"error: {CONFIG}: llama-3.1-70b on l4 (tensor_parallel_size=1, "
                           "pipeline_parallel_size=1): model weights take 131.45 GiB per GPU "
                           "but only")


def test_estimate_warns_when_the_batch_overflows_the_kv_cache(capsys):
    rc, err = cli(capsys, "estimate", CONFIG, "--batch-size", "256", "--context", "131072",
                  "--json")
    assert rc == 0
    warn = [ln for ln in err.splitlines() if "KV-cache blocks" in ln]
    assert len(warn) == 1 and warn[0].startswith("warning: estimate: the batch needs "
                                                 "2,097,152 KV-cache blocks, more than the ")
    rc, err = cli(capsys, "estimate", CONFIG, "--batch-size", "256", "--context", "1024",
                  "--json")
    assert rc == 0 and "KV-cache blocks" not in err
