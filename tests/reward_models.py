"""A tiny sequence-classification reward model on the embedded tokenizer, for the tests that score
with one (rewards/, the trainer)."""

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from infsamp.models.tiny import build_tokenizer


def save_reward_model(path, chat_template=None):
    tokenizer = build_tokenizer()
    if chat_template:
        tokenizer.chat_template = chat_template
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=512, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
