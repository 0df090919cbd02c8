"""The embedded default model: a tiny Llama with a character-level tokenizer.

`build_tokenizer()` makes a `tokenizers` WordLevel model over printable ASCII characters (one token
per character) plus the four XML tags of the answer format as single tokens, wrapped as a
transformers `PreTrainedTokenizerFast`. `build_model()` makes a standard `LlamaForCausalLM` from a
config with a 2048-token context. `scripts/train_embedded_model.py` warms it up by supervised
fine-tuning.

Deliberately simple: no merges, no byte fallback (characters outside printable ASCII map to <unk>).
"""

from __future__ import annotations

import string

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
TAG_TOKENS = ["<reasoning>", "</reasoning>", "<answer>", "</answer>"]
# digits, letters, punctuation, space, \t, \n
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c\r"]
MAX_CONTEXT = 2048


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        model_max_length=MAX_CONTEXT, padding_side="left", clean_up_tokenization_spaces=False,
    )


def model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=MAX_CONTEXT,
        rope_theta=10000.0, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, rms_norm_eps=1e-5,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(model_config(tokenizer))
