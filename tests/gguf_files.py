"""Tiny GGUF files for tests, written with the `gguf` package from a tiny random Llama.

`write_tiny_gguf(path)` writes what llama.cpp's converter writes for a Llama: the architecture's
metadata, a byte-level BPE tokenizer (three ChatML control tokens, the 256 byte symbols, two
merges) with a chat template, and the weights under GGUF names, q/k rows permuted as llama.cpp
does, 2-D weights as Q8_0 blocks and norms as F32. Returns the transformers model it came from.
`lies={"add_block_count": 3}` writes that metadata value instead of the model's (a file whose
metadata does not describe its tensors).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokens() -> list[str]:
    return SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tiny_tokens()), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5)
    return LlamaForCausalLM(config).eval()


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary halves)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _writing(add, value):
    """A writer method that writes `value` whatever it is given (a lie in the metadata)."""
    return lambda _: add(value)


def write_tiny_gguf(path: Path, architecture: str = "llama", seed: int = 0,
                    lies: dict[str, int] | None = None) -> LlamaForCausalLM:
    import gguf

    model = tiny_llama(seed)
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    for method, value in (lies or {}).items():
        setattr(writer, method, _writing(getattr(writer, method), value))
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = tiny_tokens()
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                           + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied to the embedding: llama.cpp writes no output.weight
        data = tensor.float().numpy()
        if key.endswith("q_proj.weight"):
            data = _permute(data, config.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            data = _permute(data, config.num_key_value_heads)
        name = names.get_name(key, try_suffixes=(".weight",))
        if data.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
