"""Two tiny local chat models built from configs (random weights, no download), as instruct models.

- `llama3`: a Llama-3-style tokenizer whose chat template writes `<|begin_of_text|>` and which also
  adds BOS itself (its post-processor), eos `<|eot_id|>`; the model config's eos: `<|end_of_text|>`;
  the generation config lists end of text, end of message and end of turn (Llama-3.2-Instruct).
- `qwen3`: a Qwen3-style tokenizer with `<|im_start|>` / `<|im_end|>`, no BOS, eos `<|im_end|>`, pad
  `<|endoftext|>`, and a template with Qwen3's `enable_thinking` switch (off: an empty think block
  ends the prompt); the generation config lists `<|im_end|>` and `<|endoftext|>`.
Both tokenizers are character level (`tokenizers` WordLevel, as `infsamp.models.tiny`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from infsamp.models.tiny import CHARACTERS

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|finetune_right_pad_id|>"]
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def _char_tokenizer(specials: list[str], extra_tokens: list[str]) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(specials + CHARACTERS + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, normalized=False) for t in extra_tokens])
    return tok


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    tok = _char_tokenizer(LLAMA3_SPECIALS, [])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>",
                                   unk_token="<unk>", chat_template=LLAMA3_TEMPLATE,
                                   clean_up_tokenization_spaces=False)


def qwen3_tokenizer() -> PreTrainedTokenizerFast:
    tok = _char_tokenizer(QWEN3_SPECIALS, ["<think>", "</think>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<unk>",
                                   chat_template=QWEN3_TEMPLATE, clean_up_tokenization_spaces=False)


SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
             tie_word_embeddings=True)


def build_chat_model(style: str, path: Path) -> Path:
    """Save a random tiny `style` ('llama3' or 'qwen3') chat model and its tokenizer to `path`."""
    torch.manual_seed(0)
    if style == "llama3":
        tokenizer = llama3_tokenizer()
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAMA3_SPECIALS}
        config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=ids["<|begin_of_text|>"],
                             eos_token_id=ids["<|end_of_text|>"],
                             pad_token_id=tokenizer.pad_token_id, **SIZES)
        model = LlamaForCausalLM(config)
        stops = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    else:
        tokenizer = qwen3_tokenizer()
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN3_SPECIALS}
        config = Qwen3Config(vocab_size=len(tokenizer), eos_token_id=ids["<|im_end|>"],
                             pad_token_id=tokenizer.pad_token_id, **SIZES)
        model = Qwen3ForCausalLM(config)
        stops = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=stops,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def stop_tokens_of(style: str) -> list[str]:
    """The tokens that must end a completion of `style`, as the real models list them."""
    if style == "llama3":
        return ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    return ["<|im_end|>", "<|endoftext|>"]
