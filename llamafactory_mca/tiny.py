"""Tiny random models from the real ``transformers`` config classes, for tests, the demo and benchmarks.

Shapes are chosen to exercise what breaks: grouped-query attention, a vocabulary that is not a
multiple of 128 (padding), explicit head_dim, odd and even expert counts, tied and untied embeddings.
Nothing is downloaded.
"""

from __future__ import annotations

import os
from typing import Any

import torch


BASE = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            initializer_range=0.05)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2, router_aux_loss_coef=0.0)

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(BASE),
    "llama3_tied": dict(BASE, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}, rope_theta=500000.0),
    "mistral": dict(BASE, sliding_window=None),
    "qwen2": dict(BASE),
    "qwen3": dict(BASE, head_dim=24),
    "qwen2_moe": dict(BASE, **MOE, num_experts=4, shared_expert_intermediate_size=48, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(BASE, **MOE, num_experts=4, head_dim=16, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "mixtral": dict(BASE, intermediate_size=32, num_local_experts=3, num_experts_per_tok=2, router_aux_loss_coef=0.0,
                    sliding_window=None),
}


def model_type_of(name: str) -> str:
    return "llama" if name.startswith("llama") else name


def tiny_hf_config(name: str, **overrides: Any):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type_of(name), **{**TINY[name], **overrides})


def save_tiny_model(name: str, directory: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides: Any) -> str:
    """Write a random tiny HF model of family ``name`` (see ``TINY``) to ``directory``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(name, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    return directory


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_tiny_tokenizer(directory: str, corpus: list[str] | None = None, vocab_size: int = 200) -> str:
    """A byte-level BPE tokenizer (trained here on a few sentences) with Qwen-style chat tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = corpus or [
        "The quick brown fox jumps over the lazy dog.", "Megatron trains large language models in parallel.",
        "Hello, how are you today? I am fine, thank you.", "Write a short poem about the sea and the sky.",
        "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12.", "LLaMA-Factory fine-tunes models with simple YAML recipes.",
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[1:], chat_template=CHAT_TEMPLATE)
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return directory
