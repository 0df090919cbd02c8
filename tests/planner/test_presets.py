"""Model shapes: presets' exact parameter counts, reading config.json, and agreement with
transformers."""

import dataclasses
import json
import subprocess
import sys

import pytest

from infsamp.errors import ModelError
from infsamp.planner import (
    PRESETS,
    count_lora_parameters,
    count_parameters,
    load_shape,
    shape_from_config,
)

# Totals published with the checkpoints (safetensors metadata / model cards).
EXACT_TOTALS = {
    "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360, "qwen3-14b": 14_768_307_200, "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-3b": 3_085_938_688, "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664, "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
}
ADVERTISED_BILLIONS = {
    "qwen3-0.6b": 0.6, "qwen3-1.7b": 1.7, "qwen3-4b": 4.0, "qwen3-8b": 8.2, "qwen3-14b": 14.8,
    "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.61,
    "qwen2.5-14b": 14.7, "llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "llama-3.1-8b": 8.03,
}


def test_every_requested_preset_exists():
    assert set(PRESETS) == set(EXACT_TOTALS)


@pytest.mark.parametrize("name", sorted(EXACT_TOTALS))
def test_parameter_count_matches_published_total(name):
    assert count_parameters(PRESETS[name]) == EXACT_TOTALS[name]
    assert count_parameters(PRESETS[name]) / 1e9 == pytest.approx(ADVERTISED_BILLIONS[name],
                                                                  rel=0.03)


def test_family_details():
    assert PRESETS["qwen3-0.6b"].qk_norm and not PRESETS["qwen3-0.6b"].attention_bias
    assert PRESETS["qwen2.5-7b"].attention_bias and PRESETS["qwen2.5-7b"].vocab_size == 152064
    assert PRESETS["llama-3.2-1b"].head_dim == 64 and PRESETS["llama-3.2-1b"].tie_word_embeddings
    assert not PRESETS["llama-3.1-8b"].tie_word_embeddings


def test_lora_count_all_linear_rank_16_llama_1b():
    # r * (in + out) over q, k, v, o, gate, up, down, 16 layers: peft prints 11,272,192 trainable
    per_layer = 16 * ((2048 + 2048) + 2 * (2048 + 512) + (2048 + 2048) + 3 * (2048 + 8192))
    assert count_lora_parameters(PRESETS["llama-3.2-1b"], 16) == 16 * per_layer == 11_272_192
    assert count_lora_parameters(PRESETS["llama-3.2-1b"], 0) == 0
    with pytest.raises(ModelError, match="lm_head"):
        count_lora_parameters(PRESETS["llama-3.2-1b"], 8, ("lm_head",))


def test_load_shape_preset_dir_and_file(tmp_path):
    assert load_shape("Qwen3-0.6B") is PRESETS["qwen3-0.6b"]
    config = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "tie_word_embeddings": True, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir, from_file = load_shape(str(tmp_path)), load_shape(str(tmp_path / "config.json"))
    assert dataclasses.replace(from_dir, name="x") == dataclasses.replace(from_file, name="x")
    assert from_dir.head_dim == 16 and from_dir.attention_bias and not from_dir.qk_norm


@pytest.mark.parametrize("content, match",
                         [("{not json", "cannot read JSON"), ("[1, 2]", "JSON object"),
                                            ('{"hidden_size": 8}', "missing key")])
def test_unreadable_configs_raise_one_line(tmp_path, content, match):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ModelError, match=match) as info:
        load_shape(str(path))
    assert "\n" not in str(info.value)


def test_unknown_name_lists_presets():
    with pytest.raises(ModelError, match="not a preset.*qwen3-0.6b"):
        load_shape("qwen9-1b")


def test_planner_imports_no_torch():
    code = ("import sys, infsamp.planner, infsamp.planner.report, infsamp.commands.plan; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=128)


@pytest.mark.parametrize("family", ["LlamaConfig", "Qwen2Config", "Qwen3Config"])
@pytest.mark.parametrize("tie", [True, False])
def test_counts_match_transformers_and_peft(family, tie):
    import transformers
    from peft import LoraConfig, get_peft_model

    config = getattr(transformers, family)(**TINY, tie_word_embeddings=tie)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config, name=family)
    assert count_parameters(shape) == sum(p.numel() for p in model.parameters())
    lora = get_peft_model(model,
                          LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert count_lora_parameters(shape, 4) == trainable
