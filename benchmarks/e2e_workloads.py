"""What the end-to-end bench trains: model shapes, the workloads and their runs, and the random-weight model and
synthetic data each one needs (built once, cached under ``--work``).

The runner and the report read these declarations; nothing here launches a run. torch, transformers and
llamafactory_mca are imported inside the builders (about 1.5 s), so ``--help`` and ``--merge`` do not wait for them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


# Real shapes (random weights): Qwen3-1.7B and Qwen3-30B-A3B (layers set per run).
QWEN3_1_7B = dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                  max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], router_aux_loss_coef=0.001, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
# GLM-4.5-Air (zai-org/GLM-4.5-Air config.json): layer 0 dense, then 128 routed experts (top 8, sigmoid routing with a
# correction bias) + 1 shared; q/k/v biases, RoPE on half of each head; layers set per run.
GLM_4_5_AIR = dict(model_type="glm4_moe", hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
                   num_key_value_heads=8, head_dim=128, intermediate_size=10944, moe_intermediate_size=1408,
                   n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
                   n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True,
                   use_qk_norm=False, partial_rotary_factor=0.5, vocab_size=151552, max_position_embeddings=131072,
                   rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)
# Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json), DeepSeek-V3's architecture: multi-latent attention
# (no q low rank, kv rank 512, q/k heads 128 + 64 RoPE, values 128), layer 0 dense, 64 routed experts (top 6, one
# group) + 2 shared; layers set per run.
MOONLIGHT = dict(model_type="deepseek_v3", hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                 num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, intermediate_size=11264, moe_intermediate_size=1408, n_routed_experts=64,
                 n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, n_group=1, topk_group=1,
                 routed_scaling_factor=2.446, norm_topk_prob=True, vocab_size=163840, max_position_embeddings=8192,
                 rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
# GLM-5 (zai-org/GLM-5 config.json): DeepSeek-V3's multi-latent attention (q rank 2048, kv rank 512, q/k heads of
# 192 + 64 RoPE, values 256) with DeepSeek sparse attention (an indexer of 32 heads of 128 keeping 2048 keys per
# query), the first 3 layers dense, 256 routed experts (top 8) + 1 shared, a multi-token-prediction layer; layers set
# per run.
GLM_5 = dict(model_type="glm_moe_dsa", hidden_size=6144, num_hidden_layers=78, num_attention_heads=64,
             num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
             v_head_dim=256, intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=256,
             n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5,
             norm_topk_prob=True, index_topk=2048, index_head_dim=128, index_n_heads=32, num_nextn_predict_layers=1,
             vocab_size=154880, max_position_embeddings=202752, rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct config.json): gated delta-rule layers (16 key / 32 value heads
# of 128) with every 4th layer gated full attention (16 heads of 256, 2 kv heads, RoPE on a quarter), 512 routed
# experts (top 10) + a gated shared expert in every layer; layers and their kinds set per run (``layer_pattern``).
QWEN3_NEXT_80B = dict(model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
                      num_key_value_heads=2, head_dim=256, intermediate_size=5120, moe_intermediate_size=512,
                      shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                      linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
                      vocab_size=151936, max_position_embeddings=262144, rope_theta=1e7, rms_norm_eps=1e-6,
                      tie_word_embeddings=False)
# Gemma 3 1B (google/gemma-3-1b-pt config.json): GeGLU, sandwich norms, one kv head of 256, windows of 512 tokens on
# five of every six layers (RoPE base 10,000 there, 1,000,000 on the global ones), a 262,144-token vocabulary.
GEMMA3_1B = dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=256, intermediate_size=6912, vocab_size=262144,
                 query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                 tie_word_embeddings=True)
# Gemma 4 31B (google/gemma-4-31B-it config.json, its text model): GeGLU, sandwich norms, 32 query heads; windows of
# 1,024 tokens on five of every six layers (16 kv heads of 256, RoPE base 10,000); the others full attention with
# heads of 512, 4 kv heads whose keys are the values and proportional RoPE on a quarter; soft-capped logits; layers
# and their kinds set per run
GEMMA4_31B = dict(model_type="gemma4_text", hidden_size=5376, num_hidden_layers=60, intermediate_size=21504,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=256, num_global_key_value_heads=4,
                  global_head_dim=512, attention_k_eq_v=True, sliding_window=1024, final_logit_softcapping=30.0,
                  hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                  enable_moe_block=False, vocab_size=262144, max_position_embeddings=262144, rms_norm_eps=1e-6,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1000000.0}},
                  tie_word_embeddings=True)
# Gemma 4 26B-A4B (google/gemma-4-26B-A4B-it config.json, its text model): 2816 wide, 16 query heads; in every layer
# a dense MLP of 2112 beside 128 routed experts of 704 (top 8); Gemma 4's windowed layers (8 kv heads of 256) and
# full-attention ones (2 kv heads of 512, the keys the values); layers and their kinds set per run
GEMMA4_26B_A4B = {**GEMMA4_31B, **dict(hidden_size=2816, num_hidden_layers=30, intermediate_size=2112,
                                       num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                                       enable_moe_block=True, num_experts=128, top_k_experts=8,
                                       moe_intermediate_size=704)}
# Gemma 4 E2B (google/gemma-4-E2B-it config.json, its text model): 35 layers of 1536, 8 query heads and one kv head
# (256 on the windowed layers, 512 on every 5th, full attention), windows of 512; per-layer inputs of 256 per layer
# (a 262,144 x 8,960 second embedding); the last 20 layers attend with layers 13's and 14's keys and values, their
# MLP twice as wide (12,288 instead of 6,144)
GEMMA4_E2B = {**GEMMA4_31B, **dict(hidden_size=1536, num_hidden_layers=35, intermediate_size=6144,
                                   num_attention_heads=8, num_key_value_heads=1, num_global_key_value_heads=None,
                                   attention_k_eq_v=False, sliding_window=512, hidden_size_per_layer_input=256,
                                   vocab_size_per_layer_input=262144, num_kv_shared_layers=20,
                                   use_double_wide_mlp=True)}
# gpt-oss-20b (openai/gpt-oss-20b config.json, bf16 in place of its MXFP4 experts): 64 query heads of 64, 8 kv heads,
# sinks, windows of 128 tokens on every other layer, YaRN x32, 32 biased experts (top 4) of 2880 in every layer
GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32,
                   num_experts_per_tok=4, sliding_window=128, vocab_size=201088, max_position_embeddings=131072,
                   router_aux_loss_coef=0.9, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
# MiniMax-M2 (MiniMaxAI/MiniMax-M2 config.json; transformers' MiniMaxM2Config defaults): 62 layers of 3072, 48 query
# heads and 8 kv heads of 128 with q/k norms across all heads of a token and RoPE on half of each head; in every layer
# 256 experts of 1536 (top 8) routed by sigmoid scores with a correction bias
MINIMAX_M2 = dict(model_type="minimax_m2", hidden_size=3072, num_hidden_layers=62, num_attention_heads=48,
                  num_key_value_heads=8, head_dim=128, intermediate_size=1536, num_local_experts=256,
                  num_experts_per_tok=8, router_aux_loss_coef=0.001, vocab_size=200064, max_position_embeddings=196608,
                  rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5})
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, max_position_embeddings=2048)
SMOKE_SHAPES = {"dense": {**QWEN3_1_7B, **TINY}, "dense8b": {**QWEN3_8B, **TINY},
                "moe": {**QWEN3_30B_A3B, **TINY, "num_experts": 8, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32},
                "glm": {**GLM_4_5_AIR, **TINY, "n_routed_experts": 8, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32},
                "moonlight": {**MOONLIGHT, **TINY, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                              "qk_rope_head_dim": 8, "head_dim": 8, "v_head_dim": 8, "n_routed_experts": 8,
                              "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32},
                "next": {**QWEN3_NEXT_80B, **TINY, "num_experts": 8, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}}
# Vision-language shapes, each with its real vision tower (frozen, as LLaMA-Factory's default) and layers set per run:
# Qwen2.5-VL-7B (32-block windowed tower) and Qwen3-VL-30B-A3B (27-block tower with deepstack, 128 experts).
QWEN2_5_VL_7B = dict(model_type="qwen2_5_vl",
                     text_config=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                      num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                      max_position_embeddings=128000, rms_norm_eps=1e-6,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                       "mrope_section": [16, 24, 24]}),
                     vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                        out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                                        temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                        hidden_act="silu"),
                     tie_word_embeddings=False)
QWEN3_VL_30B_A3B = dict(model_type="qwen3_vl_moe",
                        text_config=dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                         num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                         decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                                         vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6,
                                         rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                          "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
                        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                           out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
                                           temporal_patch_size=2, num_position_embeddings=2304,
                                           deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh"),
                        tie_word_embeddings=False)
# Qwen3.5-35B-A3B (transformers' Qwen3_5MoeConfig defaults are its shape; the tower's output width set to the text
# width, the hub's rotary base and 3-D sections): Qwen3-Next's hybrid decoder with 256 experts (top 8) and a gated
# shared expert in every layer, Qwen3-VL's 27-block tower without deepstack, and its multi-token-prediction layer
QWEN3_5_35B_A3B = dict(model_type="qwen3_5_moe",
                       text_config=dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
                                        num_experts_per_tok=8, moe_intermediate_size=512,
                                        shared_expert_intermediate_size=512, router_aux_loss_coef=0.001,
                                        vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                         "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                         "mrope_interleaved": True},
                                        mtp_num_hidden_layers=1),
                       vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                          out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
                                          temporal_patch_size=2, num_position_embeddings=2304,
                                          hidden_act="gelu_pytorch_tanh"),
                       tie_word_embeddings=False)
# GLM-4.5V: GLM-4.5-Air's decoder (without its MTP layer) under 3-D RoPE (T 8, H 12, W 12 of the rotary half), and
# transformers' Glm4vMoeVisionConfig defaults for the 24-block tower (1536 wide; its blocks' MLPs 4096)
GLM_4_5V = dict(model_type="glm4v_moe",
                text_config=dict({k: v for k, v in GLM_4_5_AIR.items()
                                  if k not in ("model_type", "use_qk_norm", "rope_theta", "partial_rotary_factor",
                                               "tie_word_embeddings")},
                                 max_position_embeddings=65536,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]}),
                vision_config=dict(depth=24, hidden_size=1536, num_heads=12, out_hidden_size=4096, patch_size=14,
                                   image_size=336, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu"),
                tie_word_embeddings=False)
# Gemma 3 27B with images (google/gemma-3-27b-it config.json): 62 layers of 5376, 32 query heads and 16 kv heads of
# 128, windows of 1024 tokens on five of every six layers, linear RoPE x8 on the others; a SigLIP encoder (27 blocks of
# 1152, MLP 4304) of 896-pixel images in 14-pixel patches, pooled 4 x 4 into 256 tokens per image
GEMMA3_27B = dict(model_type="gemma3",
                  text_config=dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                                   num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                                   query_pre_attn_scalar=168, sliding_window=1024, vocab_size=262208,
                                   max_position_embeddings=131072, rms_norm_eps=1e-6,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1e6}}),
                  vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                     num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False),
                  mm_tokens_per_image=256, tie_word_embeddings=True)
# Gemma 4 31B with images (google/gemma-4-31B-it config.json): the text model above, its images' tokens seeing one
# another on the windowed layers; a 27-block encoder of 1152 (heads of 72) of 16-pixel patches pooled 3 x 3, each
# image resized to at most 280 tokens (a square one: 768 pixels, 256 tokens); no audio tower (tiny.py's layout)
GEMMA4_31B_VL = dict(model_type="gemma4",
                     text_config=dict({k: v for k, v in GEMMA4_31B.items() if k != "model_type"},
                                      use_bidirectional_attention="vision"),
                     vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                        num_attention_heads=16, num_key_value_heads=16, head_dim=72, patch_size=16,
                                        pooling_kernel_size=3, position_embedding_size=10240, standardize=True),
                     mm_tokens_per_image=280)
# InternVL 3.5 8B (OpenGVLab/InternVL3_5-8B-HF config.json): Qwen3-8B's decoder and the 24-block InternViT-300M
# (1024 wide) of 448-pixel tiles in 14-pixel patches, the projector folding 2 x 2 into 256 tokens per tile. The 38B's
# InternViT-6B tower would outweigh the decoder layers one GPU holds, on both paths
INTERNVL3_5_8B = dict(model_type="internvl",
                      text_config=dict({k: v for k, v in QWEN3_8B.items() if k != "model_type"}, model_type="qwen3"),
                      vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                         num_attention_heads=16, image_size=[448, 448], patch_size=[14, 14]),
                      mm_tokens_per_image=256, tie_word_embeddings=False)  # (InternVLConfig's default ties them)
VL = {"vl": QWEN2_5_VL_7B, "vl_moe": QWEN3_VL_30B_A3B, "vl_next": QWEN3_5_35B_A3B, "glm_vl": GLM_4_5V,
      "gemma_vl": GEMMA3_27B, "gemma4_vl": GEMMA4_31B_VL, "internvl": INTERNVL3_5_8B}
VL_TEMPLATE = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl_moe": "qwen3_vl_nothink", "qwen3_5_moe": "qwen3_5_nothink",
               "glm4v_moe": "glm4_5v", "gemma3": "gemma3", "gemma4": "gemma4", "internvl": "intern_vl"}
SMOKE_SHAPES |= {kind: dict(model_type=shape["model_type"]) for kind, shape in VL.items()}  # tiny.py's shapes
# GLM-4.5-Air as released, with its multi-token-prediction layer (an MoE layer): ours trains it, LLaMA-Factory's
# default path drops it (transformers has no MTP)
SMOKE_SHAPES["glm_mtp"] = {**SMOKE_SHAPES["glm"], "num_nextn_predict_layers": 1}
SMOKE_SHAPES["gemma3"] = {**GEMMA3_1B, **TINY, "sliding_window": 64, "query_pre_attn_scalar": 16}
SMOKE_SHAPES["gemma4"] = {**GEMMA4_31B, **TINY, "num_global_key_value_heads": 1, "global_head_dim": 32,
                          "sliding_window": 64}
SMOKE_SHAPES["gemma4_moe"] = {**SMOKE_SHAPES["gemma4"], "enable_moe_block": True, "num_experts": 8,
                              "top_k_experts": 2, "moe_intermediate_size": 32}
SMOKE_SHAPES["gemma4_e2b"] = {**GEMMA4_E2B, **TINY, "global_head_dim": 32, "sliding_window": 64,
                              "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": TINY["vocab_size"]}
SMOKE_SHAPES["minimax_m2"] = {**MINIMAX_M2, **TINY, "num_local_experts": 8, "num_experts_per_tok": 2,
                              "intermediate_size": 32}
SMOKE_SHAPES["gpt_oss"] = {**GPT_OSS_20B, **TINY, "num_local_experts": 8, "num_experts_per_tok": 2,
                           "sliding_window": 64}
# (no head_dim: GLM-5's config reads it as qk_rope_head_dim; 16 indexer heads: ties between keys' scores are rare)
SMOKE_SHAPES["glm5"] = {**GLM_5, **{k: v for k, v in TINY.items() if k != "head_dim"}, "num_key_value_heads": 4,
                        "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                        "v_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                        "index_n_heads": 16, "index_head_dim": 16, "index_topk": 64}
SHAPES = {"dense": QWEN3_1_7B, "dense8b": QWEN3_8B, "moe": QWEN3_30B_A3B, "glm": GLM_4_5_AIR,
          "glm_mtp": {**GLM_4_5_AIR, "num_nextn_predict_layers": 1}, "moonlight": MOONLIGHT, "next": QWEN3_NEXT_80B,
          # GLM-5 without its MTP layer: one more full-size MoE layer (~19 GB) filled the GPU machine's 64 GiB disk,
          # and LLaMA-Factory's default path drops it anyway
          "glm5": {**GLM_5, "num_nextn_predict_layers": 0},
          "gemma3": GEMMA3_1B, "gemma4": GEMMA4_31B, "gemma4_moe": GEMMA4_26B_A4B, "gemma4_e2b": GEMMA4_E2B,
          "gpt_oss": GPT_OSS_20B, "minimax_m2": MINIMAX_M2, **VL}
LABELS = {"dense": "Qwen3-1.7B shape", "dense8b": "Qwen3-8B shape", "moe": "Qwen3-30B-A3B shape",
          "glm": "GLM-4.5-Air shape", "glm_mtp": "GLM-4.5-Air shape with its MTP layer",
          "moonlight": "Moonlight-16B-A3B shape (DeepSeek-V3 architecture)",
          "next": "Qwen3-Next-80B-A3B shape",
          "gemma3": "Gemma-3-1B shape",
          "gemma4": "Gemma-4-31B shape",
          "gemma4_moe": "Gemma-4-26B-A4B shape",
          "gemma4_e2b": "Gemma-4-E2B shape",
          "gpt_oss": "gpt-oss-20b shape",
          "minimax_m2": "MiniMax-M2 shape",
          "glm5": "GLM-5 shape (DeepSeek sparse attention)",
          "vl": "Qwen2.5-VL-7B shape",
          "vl_moe": "Qwen3-VL-30B-A3B shape",
          "vl_next": "Qwen3.5-35B-A3B shape",
          "glm_vl": "GLM-4.5V shape",
          "gemma_vl": "Gemma-3-27B shape (with images)",
          "gemma4_vl": "Gemma-4-31B shape (with images)",
          "internvl": "InternVL-3.5-8B shape"}
MOE_KINDS = ("moe", "vl_moe", "vl_next", "glm_vl", "glm", "glm_mtp", "moonlight", "next", "gpt_oss", "glm5",
             "gemma4_moe", "minimax_m2")


def image_side(kind: str, smoke: bool) -> int:
    """Pixels per image side: 32 x 32 patches (256 tokens after the 2 x 2 merge; Gemma 4 resizes it to 48 x 48
    patches, 256 tokens after its 3 x 3 pooling); smoke: tiny.py's 32 pixels."""
    patch = VL[kind]["vision_config"]["patch_size"]
    return 32 if smoke else 32 * (patch[0] if isinstance(patch, list) else patch)


@dataclass
class Run:
    name: str
    path: str  # "lf" (LLaMA-Factory's HF Trainer) or "ours" (USE_MCA=1)
    gpus: int
    packing: bool
    micro_batch: int
    grad_accum: int
    layout: str
    extra: dict = field(default_factory=dict)  # the run's own recipe keys (parallel sizes, recompute; Liger for LF)


@dataclass
class Workload:
    name: str
    model: str  # "dense" or "moe"
    cutoff: int
    lengths: tuple  # ("uniform" | "loguniform", low, high) in tokens per row
    runs: list
    steps: int = 12
    warmup: int = 4
    about: str = ""
    layers: int | None = None  # all of the shape's layers (default: as many as --layers / the GPU allow)
    tuning: dict = field(default_factory=dict)  # recipe keys for both paths (LoRA)


# LLaMA-Factory's examples/deepspeed/ds_z3_config.json and ds_z2_config.json (without their fp16 blocks): what its
# users run for ZeRO-3 and ZeRO-2
ZERO3 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_z3_config.json")
ZERO2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_z2_config.json")
NODE = 4  # the node workloads: one host of four GPUs
PLANNED = {"planned": True}  # the run takes the planner's first proposal for its GPUs and global batch (e2e_runner)


def _pair(gpus: int, grad_accum: int, layout: str, ours_extra: dict | None = None, lf_layout: str = "",
          packing: bool = True, micro_batch: int = 1, suffix: str = "") -> list:
    return [Run("lf" + suffix, "lf", gpus, packing, micro_batch, grad_accum, lf_layout or layout),
            Run("ours" + suffix, "ours", gpus, packing, micro_batch, grad_accum, layout, ours_extra or {})]


def workloads(smoke: bool) -> dict[str, Workload]:
    k = 16 if smoke else 1  # smoke: 16x shorter sequences
    cut, long_cut = 4096 // k, 32768 // 32 if smoke else 32768
    packed = ("uniform", 256 // k, 2048 // k)
    varlen = ("loguniform", max(32 // k, 4), cut)
    recompute = {"recompute_granularity": "full"}
    graphs = {"cuda_graphs": True}  # every layer replayed as a CUDA graph (packs of one size)
    fused = dict(apply_rope_fusion=True, qk_norm_fusion=True, gradient_accumulation_fusion=True)  # graphs' defaults
    unfused = {key: False for key in fused}
    # full and freeze runs turn the fusions on by default: this is the plain path beside them
    unfused_run = Run("ours_unfused", "ours", 1, True, 1, 8, "1 GPU, no fusions", unfused)
    graph_runs = [Run("ours_graphs", "ours", 1, True, 1, 8, "1 GPU, CUDA graphs", graphs),
                  Run("ours_graphs_fused", "ours", 1, True, 1, 8, "1 GPU, CUDA graphs, wgrad into main_grad",
                      dict(graphs, gradient_accumulation_fusion=True)),  # weight gradients GEMMed into main_grad
                  # graphs without the fusions they turn on by default (wgrad into main_grad, Triton RoPE, q/k norms)
                  Run("ours_graphs_unfused", "ours", 1, True, 1, 8, "1 GPU, CUDA graphs, no fusions",
                      dict(graphs, **unfused)),
                  Run("ours_graphs_mb2", "ours", 1, True, 2, 4, "1 GPU, CUDA graphs, 2 packs per micro-batch", graphs)]
    # LLaMA-Factory's fastest option a user can pick here: Liger kernels, gradient checkpointing off where it fits
    liger_gc = dict(enable_liger_kernel=True)
    liger = dict(liger_gc, disable_gradient_checkpointing=True)
    varlen_runs = (_pair(1, 4, "1 GPU, padded", packing=False, micro_batch=2, suffix="_nopack")
                   + _pair(1, 8, "1 GPU, packed", suffix="_pack"))
    found = [
        Workload("dense", "dense", cut, packed,
                 _pair(1, 8, "1 GPU")
                 + [Run("lf_liger", "lf", 1, True, 1, 8, "1 GPU, Liger, no checkpointing", liger),
                    unfused_run] + graph_runs,
                 about=f"{cut}-token packed micro-batches, global batch 8; `lf_liger`: LLaMA-Factory with "
                       "`enable_liger_kernel` and gradient checkpointing off"),
        Workload("dp2", "dense", cut, packed, _pair(2, 4, "DP2", lf_layout="DDP, 2 GPUs"),
                 about=f"{cut}-token packed micro-batches, global batch 8 (dp 2 x grad accum 4)"),
        Workload("moe", "moe", cut, packed,
                 _pair(1, 8, "1 GPU") + [Run("ours_recompute", "ours", 1, True, 1, 8, "1 GPU, recompute full",
                                             recompute),
                                         # fp32 master weights as bf16 + 16-bit remainders: 16 bytes per parameter
                                         Run("ours_recompute_rem", "ours", 1, True, 1, 8,
                                             "1 GPU, recompute full, param remainders",
                                             dict(recompute, store_param_remainders=True)),
                                         Run("lf_liger", "lf", 1, True, 1, 8, "1 GPU, Liger, checkpointing",
                                             liger_gc),
                                         Run(**vars(unfused_run)),
                                         Run("ours_mb2", "ours", 1, True, 2, 4, "1 GPU, 2 packs per micro-batch"),
                                         # 12 bytes per parameter: remainders and Adam's moments in bf16
                                         Run("ours_saving", "ours", 1, True, 1, 8,
                                             "1 GPU, param remainders, bf16 moments",
                                             dict(store_param_remainders=True, exp_avg_dtype="bf16",
                                                  exp_avg_sq_dtype="bf16")),
                                         Run("ours_graphs_merged", "ours", 1, True, 1, 8,
                                             "1 GPU, CUDA graphs, micro-batches merged by 2",
                                             dict(graphs, merge_micro_batches=2))]
                 + [Run(**vars(r)) for r in graph_runs],
                 about=f"{cut}-token packed micro-batches, global batch 8; LLaMA-Factory recomputes by default "
                       "(gradient checkpointing), so `ours_recompute` is the like-for-like memory comparison "
                       "(`ours_recompute_rem`: with `store_param_remainders`); "
                       "`lf_liger`: LLaMA-Factory with `enable_liger_kernel`"),
        Workload("moe_ep2", "moe", cut, packed, _pair(2, 4, "EP2", {"expert_model_parallel_size": 2},
                                                      lf_layout="DDP, 2 GPUs")
                 + [Run("lf_zero3", "lf", 2, True, 1, 4, "DeepSpeed ZeRO-3, 2 GPUs", {"deepspeed": ZERO3})],
                 about=f"{cut}-token packed micro-batches, global batch 8 (dp 2 x grad accum 4); `lf_zero3`: "
                       "LLaMA-Factory with DeepSpeed ZeRO-3 (its ds_z3_config.json)"),
        Workload("long", "dense", long_cut, ("uniform", int(long_cut * 0.9), long_cut),
                 [Run("lf", "lf", 1, False, 1, 2, "1 GPU, gradient checkpointing (LF default)"),
                  Run("lf_liger", "lf", 1, False, 1, 2, "1 GPU, Liger, gradient checkpointing", liger_gc),
                  Run("ours", "ours", 1, True, 1, 2, "1 GPU, recompute full", recompute),
                  Run("ours_selective", "ours", 1, True, 1, 2, "1 GPU, recompute core attention, fusions",
                      dict(fused, recompute_granularity="selective")),
                  Run("ours_no_recompute", "ours", 1, True, 1, 2, "1 GPU, no recompute, fusions", fused),
                  Run("ours_cp2", "ours", 2, True, 1, 2, "CP2, recompute full",
                      {"context_parallel_size": 2, **recompute})],
                 steps=8, warmup=3, about=f"one {long_cut}-token sequence per micro-batch, global batch 2"),
        Workload("layouts", "dense", cut, packed,
                 [Run("ours", "ours", 1, True, 1, 8, "1 GPU"),
                  Run("ours_tp2", "ours", 2, True, 1, 8, "TP2 + SP", {"tensor_model_parallel_size": 2,
                                                                       "sequence_parallel": True}),
                  Run("ours_pp2", "ours", 2, True, 1, 8, "PP2", {"pipeline_model_parallel_size": 2})],
                 about=f"our path only: the same {cut}-token packed steps on 1 GPU, TP2 and PP2 (global batch 8)"),
        Workload("varlen", "dense", cut, varlen, varlen_runs,
                 about=f"SFT rows log-uniform {varlen[1]}..{cut} tokens; padded: 2 rows x 4, packed: 1 pack x 8"),
        Workload("varlen_moe", "moe", cut, varlen, [Run(**vars(r)) for r in varlen_runs],
                 about=f"SFT rows log-uniform {varlen[1]}..{cut} tokens; padded: 2 rows x 4, packed: 1 pack x 8"),
    ] + [
        Workload(kind, kind, cut, ("loguniform", max(32 // k, 4), cut // 2),
                 _pair(1, 4, "1 GPU, padded", packing=False, micro_batch=2, suffix="_nopack")
                 + [Run("ours_pack", "ours", 1, True, 1, 8, "1 GPU, packed"),
                    Run("ours_pack_inline", "ours", 1, True, 1, 8, "1 GPU, packed, prefetch_steps: 0",
                        {"prefetch_steps": 0})],
                 about=f"{LABELS[kind]} sft: one {image_side(kind, smoke)}-pixel image per row (256 tokens; the tower "
                       f"frozen, LLaMA-Factory's default) and log-uniform {max(32 // k, 4)}..{cut // 2} text tokens; "
                       "padded: 2 rows x 4, packed: 1 pack x 8 (`ours_pack_inline`: each step collating its own "
                       "micro-batches, pixels included, instead of on the background thread). MFU: the language "
                       "model only")
        for kind in VL if kind != "vl_next"
    ]
    lora = dict(finetuning_type="lora", lora_rank=16, lora_alpha=32, lora_target="all")
    lora_about = ("LoRA rank 16 on `lora_target: all` (LLaMA-Factory's expansion: every attention and MLP projection "
                  "of the dense model; on Qwen3-MoE the attention projections, experts never), {cut}-token packed "
                  "micro-batches, global batch 8. MFU counts full fine-tuning's 6N FLOPs; LoRA skips the frozen "
                  "base's weight gradients (about a third of that work), so it overstates the work done by up to 1.5x")
    found += [
        Workload("lora_moe", "moe", cut, packed,
                 [Run("lf", "lf", 1, True, 1, 8, "1 GPU, gradient checkpointing (LF default)"),
                  Run("ours", "ours", 1, True, 1, 8, "1 GPU"),
                  Run("ours_recompute", "ours", 1, True, 1, 8, "1 GPU, recompute full", recompute),
                  Run("ours_experts", "ours", 1, True, 1, 8, "1 GPU, + experts", dict(lora_target="all,experts")),
                  Run("lf_mb2", "lf", 1, True, 2, 4, "1 GPU, gradient checkpointing (LF default)"),
                  Run("ours_mb2", "ours", 1, True, 2, 4, "1 GPU"),
                  # LoRA's default keeps the fusions off (measured here when MoE's default still turned them on)
                  Run("ours_unfused", "ours", 1, True, 1, 8, "1 GPU, no fusions", unfused),
                  Run("ours_fused", "ours", 1, True, 1, 8, "1 GPU, the fusions", fused),
                  Run("ours_graphs", "ours", 1, True, 1, 8, "1 GPU, CUDA graphs", graphs),
                  Run("ours_graphs_mb2", "ours", 1, True, 2, 4, "1 GPU, CUDA graphs", graphs)],
                 steps=6, warmup=2, layers=None if smoke else 48, tuning=lora,
                 about=lora_about.format(cut=cut) + "; `ours_experts` also adapts every expert (not possible in "
                       "LLaMA-Factory's default path); `*_mb2`: 2 packs of 4096 tokens per micro-batch x 4 (the same "
                       "global batch); `ours_graphs*`: every layer, adapters included, replayed as a CUDA graph"),
        Workload("gemma3", "gemma3", cut, packed, _pair(1, 8, "1 GPU") + [Run(**vars(graph_runs[0]))], steps=10,
                 warmup=3, layers=2 if smoke else 26,
                 about=f"full fine-tuning of the whole model (26 layers, windows of 512 tokens on 5 of every 6), "
                       f"{cut}-token packed micro-batches, global batch 8"),
        Workload("gemma4", "gemma4", cut, packed, _pair(1, 8, "1 GPU"), steps=10, warmup=3,
                 layers=2 if smoke else 6,
                 about=f"full fine-tuning of the first layers (6 by default: five of every six windowed, the last "
                       f"full attention; with the 262,144-token tied embedding), {cut}-token packed micro-batches, "
                       "global batch 8"),
        Workload("gemma4_moe", "gemma4_moe", cut, packed, _pair(1, 8, "1 GPU"), steps=8, warmup=3,
                 layers=2 if smoke else 4,
                 about=f"full fine-tuning of the first layers (4 by default: 3 windowed, the last full attention; "
                       f"each a dense MLP beside 128 experts: with the embedding about what one H200 holds with "
                       f"Adam states; 3 on an 80 GB GPU), "
                       f"{cut}-token packed micro-batches, global batch 8"),
        Workload("gemma4_e2b", "gemma4_e2b", cut, packed,
                 _pair(1, 8, "1 GPU") + [Run("ours_unmerged", "ours", 1, True, 1, 8, "1 GPU, packs one by one",
                                             {"merge_micro_batches": 1})],
                 steps=10, warmup=3, layers=6 if smoke else 35,
                 about=f"full fine-tuning of the whole model (35 layers: per-layer inputs, the last 20 attending with "
                       f"earlier layers' keys and values; 4.6B parameters with both embeddings), {cut}-token packed "
                       "micro-batches, global batch 8 (ours: `merge_micro_batches: auto` runs 2 packs as one; "
                       "`ours_unmerged`: one by one, as the recipe says)"),
        Workload("gpt_oss", "gpt_oss", cut, packed,
                 [Run("lf_nopack", "lf", 1, False, 2, 4, "1 GPU, padded, eager attention"),
                  Run("ours", "ours", 1, True, 1, 8, "1 GPU, packed"),
                  Run("ours_nopack", "ours", 1, False, 2, 4, "1 GPU, padded"),
                  Run("ours_aux", "ours", 1, True, 1, 8, "1 GPU, packed, the checkpoint's load balancing",
                      {"moe_balancing": "checkpoint"})],
                 steps=10, warmup=3, layers=2,
                 about=f"full fine-tuning of the first 2 layers (every layer 32 biased experts: what fits one GPU "
                       f"with Adam states), SFT rows uniform {packed[1]}..{packed[2]} tokens; LLaMA-Factory: 2 "
                       "padded rows x 4 (its collator refuses neat_packing for gpt-oss) with transformers' eager "
                       "attention (its default path loads a FlashAttention-3 kernel from the hub, not measured "
                       "here); ours: 1 pack x 8 (more rows per step than the padded ones: not the same training), "
                       "and the same padded rows (`ours_nopack`, the same training); neither trains a load-balancing "
                       "loss by default; `ours_aux` trains the checkpoint's (router_aux_loss_coef 0.9)"),
        Workload("glm_moe", "glm", cut, packed, _pair(1, 8, "1 GPU"), steps=10, warmup=3, layers=2 if smoke else 3,
                 about=f"full fine-tuning of the first 3 layers (1 dense, 2 MoE: as many as fit one H200 with Adam "
                       f"states), {cut}-token packed micro-batches, global batch 8"),
        Workload("glm_mtp", "glm_mtp", cut, packed,
                 _pair(1, 8, "1 GPU") + [Run("ours_no_mtp", "ours", 1, True, 1, 8, "1 GPU, mtp_num_layers: 0",
                                             dict(mtp_num_layers=0))],
                 steps=10, warmup=3, layers=2,
                 about=f"full fine-tuning of the first 2 layers (1 dense, 1 MoE) and the multi-token-prediction layer "
                       f"(MoE; ours trains it, LLaMA-Factory's default path drops it; `ours_no_mtp` leaves it out "
                       f"too, like for like), {cut}-token packed micro-batches, global batch 8"),
        Workload("moonlight", "moonlight", cut, packed, _pair(1, 8, "1 GPU"), steps=10, warmup=3,
                 layers=2 if smoke else 8,
                 about=f"full fine-tuning of the first 8 layers (1 dense, 7 MoE: about what fits one H200 with Adam "
                       f"states), {cut}-token packed micro-batches, global batch 8"),
        Workload("qwen3_next", "next", cut, varlen, [Run(**vars(r)) for r in varlen_runs]
                 + [Run("ours_nopack_padded", "ours", 1, False, 2, 4, "1 GPU, padded BSHD", {"padding_free": False})],
                 steps=8, warmup=3, layers=2 if smoke else 3,
                 about=f"full fine-tuning of 3 layers (2 gated delta-rule, 1 gated full attention; every layer 512 "
                       f"experts: what fits one H200 with Adam states), SFT rows log-uniform {varlen[1]}..{cut} "
                       "tokens; padded: 2 rows x 4 (ours runs the rows without their padding, `padding_free`, the "
                       "default; `ours_nopack_padded`: padded rows), packed: 1 pack x 8 (LLaMA-Factory: "
                       "neat_packing)"),
        Workload("qwen3_5", "vl_next", cut, ("loguniform", max(32 // k, 4), cut // 2),
                 _pair(1, 4, "1 GPU, padded", packing=False, micro_batch=2, suffix="_nopack")
                 + [Run("ours_nopack_no_mtp", "ours", 1, False, 2, 4, "1 GPU, padded, mtp_num_layers: 0",
                        dict(mtp_num_layers=0)),
                    Run("ours_pack", "ours", 1, True, 1, 8, "1 GPU, packed")],
                 steps=8, warmup=3, layers=2 if smoke else 4,
                 about=f"full fine-tuning of 4 layers (3 gated delta-rule, 1 gated full attention, every one 256 "
                       f"experts) and the multi-token-prediction layer (ours trains it on the image features; "
                       f"LLaMA-Factory's default path drops it; `ours_nopack_no_mtp` leaves it out too, like for "
                       f"like), sft: one {image_side('vl_next', smoke)}-pixel image per row (256 tokens; the tower "
                       f"frozen, LLaMA-Factory's default) and log-uniform {max(32 // k, 4)}..{cut // 2} text tokens; "
                       "padded: 2 rows x 4 (ours without their padding, `padding_free`), packed: 1 pack x 8. MFU: the "
                       "language model only"),
        # GLM-5: a full-size MoE layer (256 experts) is ~10B parameters, beyond one GPU with Adam states: LoRA
        Workload("glm5", "glm5", cut, packed, _pair(1, 8, "1 GPU", lf_layout="1 GPU, gradient checkpointing, eager"),
                 steps=8, warmup=2, layers=2 if smoke else 4, tuning=lora,
                 about="LoRA rank 16 on `lora_target: all` of the first 4 layers (3 dense, 1 of 256 experts: a "
                       "second one is 19 GB more to build, save and load twice in one GPU call), "
                       f"{cut}-token packed micro-batches, global batch 8; "
                       "LLaMA-Factory with transformers' eager attention (its SDPA path is not causal on rows without "
                       "padding)"),
        # MiniMax-M2: 256 experts of 3 x 3072 x 1536 make a layer 3.6B parameters (7 GB in bf16), beyond one GPU with
        # Adam states: LoRA; 8 of them (30B parameters, 60 GB) are what one H100 holds beside the activations
        Workload("minimax_m2", "minimax_m2", cut, packed,
                 _pair(1, 8, "1 GPU", lf_layout="1 GPU, gradient checkpointing (LF default)")
                 + [Run("ours_unmerged", "ours", 1, True, 1, 8, "1 GPU, packs one by one",
                        {"merge_micro_batches": 1})],
                 steps=8, warmup=2, layers=2 if smoke else 8, tuning=lora,
                 about="LoRA rank 16 on `lora_target: all` (the attention's projections, as LLaMA-Factory expands it: "
                       "the experts are 3-D parameters) of the first 8 layers (by default), each 256 experts (top 8) "
                       f"routed by sigmoid scores with a correction bias, {cut}-token packed micro-batches, global "
                       "batch 8 (ours: `merge_micro_batches: auto` runs packs together where the planner finds room; "
                       "`ours_unmerged`: one by one, as the recipe says)"),
        Workload("lora_dense", "dense8b", cut, packed,
                 _pair(1, 8, "1 GPU", lf_layout="1 GPU, gradient checkpointing (LF default)")
                 + [Run("ours_recompute", "ours", 1, True, 1, 8, "1 GPU, recompute full", recompute)],
                 steps=8, warmup=2, layers=None if smoke else 36, tuning=lora, about=lora_about.format(cut=cut)),
    ]
    found += _fp8_workloads(smoke, cut, packed, lora)
    found += _node_workloads(smoke, cut, packed, lora, recompute, graphs, liger_gc)
    if smoke:
        for w in found:
            w.steps, w.warmup = 4, 1
    return {w.name: w for w in found}


FP8 = {"tensorwise": dict(fp8="hybrid"), "rowwise": dict(fp8="e4m3", fp8_recipe="rowwise"),
       "delayed": dict(fp8="hybrid", fp8_recipe="delayed")}


def _fp8_runs(grad_accum: int = 8) -> list[Run]:
    return [Run("ours_fp8", "ours", 1, True, 1, grad_accum, "1 GPU, FP8 tensorwise (hybrid)", FP8["tensorwise"]),
            Run("ours_fp8_rowwise", "ours", 1, True, 1, grad_accum, "1 GPU, FP8 rowwise (e4m3)", FP8["rowwise"]),
            Run("ours_fp8_delayed", "ours", 1, True, 1, grad_accum, "1 GPU, FP8 delayed (hybrid)", FP8["delayed"])]


SMALL_STATES = dict(store_param_remainders=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


def _graphed_fp8_runs(with_tensorwise: bool = False) -> list[Run]:
    """bf16 and FP8 with every layer replayed as a CUDA graph: the launches of a step out of the host's way."""
    graphs = [Run("ours_graphs", "ours", 1, True, 1, 8, "1 GPU, CUDA graphs", {"cuda_graphs": True}),
              Run("ours_graphs_fp8_delayed", "ours", 1, True, 1, 8, "1 GPU, CUDA graphs, FP8 delayed (hybrid)",
                  dict(FP8["delayed"], cuda_graphs=True))]
    if with_tensorwise:
        graphs.append(Run("ours_graphs_fp8", "ours", 1, True, 1, 8, "1 GPU, CUDA graphs, FP8 tensorwise (hybrid)",
                          dict(FP8["tensorwise"], cuda_graphs=True)))
    return graphs


def _fp8_workloads(smoke: bool, cut: int, packed: tuple, lora: dict) -> list[Workload]:
    """FP8 on torch's scaled matmuls (models/native/fp8.py) beside our bf16 and LLaMA-Factory's default path: speed
    and memory on the Qwen3-8B and Qwen3-30B-A3B shapes, the loss over 200 steps on the Qwen3-1.7B shape."""
    about = ("`ours_fp8`: `fp8: hybrid` (tensorwise scaling, gradients in E5M2); `ours_fp8_rowwise`: `fp8: e4m3`, "
             "`fp8_recipe: rowwise`; `ours_fp8_delayed`: `fp8: hybrid`, `fp8_recipe: delayed`; all keep the first "
             "and last layer in bf16 (the default)")
    return [
        Workload("fp8_dense", "dense8b", cut, packed,
                 _pair(1, 8, "1 GPU") + _fp8_runs() + _graphed_fp8_runs(with_tensorwise=True), steps=8, warmup=3,
                 layers=2 if smoke else 8,
                 about=f"full fine-tuning of the first layers of 36 (8 by default: with the embedding and output "
                       f"layer and their Adam states, about what one 80 GB GPU holds), {cut}-token packed "
                       "micro-batches, global batch 8; " + about
                       + "; `ours_graphs*`: every layer replayed as a CUDA graph"),
        Workload("fp8_dense_deep", "dense8b", cut, packed,
                 [replace(r, layout=r.layout + ", 16-bit states", extra=dict(r.extra, **SMALL_STATES))
                  for r in _pair(1, 8, "1 GPU")[1:] + _fp8_runs()],
                 steps=8, warmup=3, layers=2 if smoke else 18,
                 about=f"full fine-tuning of the first 18 layers of 36 with the 16-bit optimizer states "
                       f"(`store_param_remainders`, bf16 Adam moments: what lets that many fit one 80 GB GPU), "
                       f"{cut}-token packed micro-batches, global batch 8: deeper, the output layer and the bf16 "
                       f"first and last layers weigh less in the step; " + about),
        Workload("fp8_lora", "dense8b", cut, packed, _pair(1, 8, "1 GPU", lf_layout="1 GPU, gradient checkpointing "
                                                            "(LF default)") + _fp8_runs() + _graphed_fp8_runs(),
                 steps=8, warmup=3, layers=None if smoke else 36, tuning=lora,
                 about=f"LoRA rank 16 on `lora_target: all` of all 36 layers (the frozen base's GEMMs in FP8: forward "
                       f"and input gradient), {cut}-token packed micro-batches, global batch 8; " + about
                       + "; `ours_graphs*`: every layer, adapters included, replayed as a CUDA graph"),
        Workload("fp8_moe", "moe", cut, packed, _pair(1, 8, "1 GPU") + _fp8_runs(), steps=8, warmup=3,
                 layers=2 if smoke else 4,
                 about=f"full fine-tuning of 4 of the 48 layers, {cut}-token packed micro-batches, global batch 8; "
                       + about),
        Workload("fp8_loss", "dense", cut, packed, [Run("ours", "ours", 1, True, 1, 2, "1 GPU, bf16")] + _fp8_runs(2),
                 steps=20 if smoke else 200, warmup=2, layers=2 if smoke else 4,
                 about=f"the loss over 200 steps: 4 layers of the Qwen3-1.7B shape, full fine-tuning, {cut}-token "
                       "packed micro-batches, global batch 2; " + about),
        Workload("fp8_loss_lora", "dense", cut, packed, [Run("ours", "ours", 1, True, 1, 2, "1 GPU, bf16")]
                 + _fp8_runs(2), steps=20 if smoke else 200, warmup=2, layers=2 if smoke else 4, tuning=lora,
                 about="as `fp8_loss`, LoRA rank 16 on `lora_target: all`; " + about),
    ]


def _node_workloads(smoke: bool, cut: int, packed: tuple, lora: dict, recompute: dict, graphs: dict,
                    liger_gc: dict) -> list[Workload]:
    """One host of four GPUs: the MoE and dense models users bring when they outgrow one GPU, against LLaMA-Factory
    with DeepSpeed, and the scaling of each parallel dimension 1 -> 2 -> 4 GPUs at one global batch (16 packs)."""
    n, zero3 = NODE, {"deepspeed": ZERO3}
    ep, dp = {"expert_model_parallel_size": n}, f"DP{n}"
    saving = dict(recompute, store_param_remainders=True)
    planned = Run("ours_planned", "ours", n, True, 1, 4, "the planner's first proposal", PLANNED)
    long_cut = 131072 // (128 if smoke else 1)
    return [
        Workload("moe_node", "moe", cut, packed,
                 [Run("lf_zero3", "lf", n, True, 1, 4, f"DeepSpeed ZeRO-3, {n} GPUs", zero3),
                  Run("ours", "ours", n, True, 1, 4, f"EP{n}", ep),
                  Run("ours_saving", "ours", n, True, 1, 4, f"EP{n}, recompute full, param remainders",
                      dict(ep, **saving)),
                  Run(**vars(planned)),
                  Run("lf_zero2", "lf", n, True, 1, 4, f"DeepSpeed ZeRO-2, {n} GPUs", {"deepspeed": ZERO2})],
                 steps=8, warmup=3, layers=2 if smoke else 12,
                 about=f"full fine-tuning of 12 of the 48 layers, {cut}-token packed micro-batches, global batch 16 "
                       f"(dp {n} x 4; EP{n}: dp {n} for attention, the experts split over the {n} GPUs); `lf_zero3`, "
                       "`lf_zero2`: LLaMA-Factory with DeepSpeed (its ds_z3_config.json / ds_z2_config.json), "
                       "gradient checkpointing on (its default); `ours_saving`: full recompute and "
                       "`store_param_remainders`"),
        Workload("moe_recipe_node", "moe", cut, packed,
                 [Run("ours_recipe", "ours", n, True, 1, 8, "PP2 x EP2, recompute full (the recipe's layout, halved)",
                      {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2, **recompute}),
                  Run("ours_pp4_vpp2", "ours", n, True, 1, 16,
                      "PP4 x VPP2, recompute full (the planner's 8-GPU proposal, halved)",
                      {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2, **recompute}),
                  Run(**vars(planned))],
                 steps=8, warmup=3, layers=8 if smoke else 24,
                 about=f"half of `examples/megatron/qwen3_moe_full.yaml` on half of its GPUs: 24 of the 48 layers "
                       f"on {n} GPUs hold as many parameters per GPU as the whole model on the recipe's 8, and global "
                       "batch 16 keeps its 8 micro-batches per pipeline. The planner predicts 1,920 tokens/s/GPU for "
                       "the recipe's PP2 x EP4 and 3,505 for its first proposal PP8 x VPP2 on 8 x 80 GiB; here the "
                       "same two layouts on half the GPUs (and the planner's first for this host) against its "
                       "predictions"),
        Workload("lora_moe_node", "moe", cut, packed,
                 [Run("lf_zero3", "lf", n, True, 1, 4, f"DeepSpeed ZeRO-3, {n} GPUs", zero3),
                  Run("ours", "ours", n, True, 1, 4, f"EP{n}", ep)],
                 steps=6, warmup=2, layers=None if smoke else 48, tuning=lora,
                 about=f"LoRA rank 16 on `lora_target: all` of all 48 layers, {cut}-token packed micro-batches, "
                       f"global batch 16; MFU counts full fine-tuning's 6N FLOPs (see `lora_moe`)"),
        Workload("dense8b_node", "dense8b", cut, packed,
                 [Run("lf_zero3", "lf", n, True, 1, 4, f"DeepSpeed ZeRO-3, {n} GPUs", zero3),
                  Run("ours_tp2", "ours", n, True, 1, 8, "TP2 + SP x DP2",
                      {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
                  Run("ours_pp2", "ours", n, True, 1, 8, "PP2 x VPP2 x DP2",
                      {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
                  Run("ours", "ours", n, True, 1, 4, dp),
                  Run(**vars(planned)),
                  Run("lf", "lf", n, True, 1, 4, f"DDP, {n} GPUs")],
                 steps=8, warmup=3, layers=None if smoke else 36,
                 about=f"full fine-tuning of the whole model (36 layers, 8.2B parameters), {cut}-token packed "
                       f"micro-batches, global batch 16; `lf`: LLaMA-Factory's DDP (16 bytes per parameter on every "
                       "GPU), `lf_zero3`: with DeepSpeed ZeRO-3"),
        Workload("scale_dense", "dense", cut, packed,
                 [Run("ours", "ours", 1, True, 1, 16, "1 GPU"), Run("ours_dp2", "ours", 2, True, 1, 8, "DP2"),
                  Run("ours_dp4", "ours", n, True, 1, 4, dp),
                  Run("ours_tp2_pp2", "ours", n, True, 1, 16, "TP2 + SP x PP2",
                      {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                       "pipeline_model_parallel_size": 2}),
                  Run("ours_cp4", "ours", n, True, 1, 16, f"CP{n}", {"context_parallel_size": n}),
                  Run("ours_pp2", "ours", 2, True, 1, 16, "PP2 x VPP2",
                      {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
                  Run("ours_dp4_graphs", "ours", n, True, 1, 4, f"{dp}, CUDA graphs", graphs)],
                 steps=20, warmup=5,
                 about=f"{cut}-token packed micro-batches, global batch 16 on every GPU count (the same batches), "
                       "20 steps: per-GPU tokens/s against one GPU's, and each layout's loss curve against one GPU's"),
        Workload("scale_moe", "moe", cut, packed,
                 [Run("ours", "ours", 1, True, 1, 16, "1 GPU"),
                  Run("ours_ep2", "ours", 2, True, 1, 8, "EP2", {"expert_model_parallel_size": 2}),
                  Run("ours_ep4", "ours", n, True, 1, 4, f"EP{n}", ep),
                  Run("ours_pp2_ep2", "ours", n, True, 1, 8, "PP2 x EP2",
                      {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
                  Run("ours_ep4_graphs", "ours", n, True, 1, 4, f"EP{n}, CUDA graphs", dict(ep, **graphs))],
                 steps=20, warmup=5,
                 about=f"{cut}-token packed micro-batches, global batch 16 on every GPU count (the same batches), "
                       "20 steps: per-GPU tokens/s against one GPU's, and each layout's loss curve against one GPU's"),
        Workload("long_node", "dense", long_cut, ("uniform", int(long_cut * 0.9), long_cut),
                 [Run("ours_cp4", "ours", n, True, 1, 2, "CP4, recompute full",
                      {"context_parallel_size": n, **recompute}),
                  Run("ours_cp2_tp2", "ours", n, True, 1, 2, "CP2 x TP2 + SP, recompute full",
                      {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True,
                       **recompute}),
                  Run("lf_liger", "lf", 1, False, 1, 2, "1 GPU, Liger, gradient checkpointing", liger_gc)],
                 steps=4, warmup=1,
                 about=f"one {long_cut}-token row per micro-batch, global batch 2 (dp 1); LLaMA-Factory's best "
                       "that could fit: one GPU with Liger's fused linear cross-entropy and gradient checkpointing"),
    ]


# ---- assets: tokenizer, random-weight model, synthetic SFT data (cached under --work) -----------------------------
WORDS = {"smoke": 200, "real": 8000}


def _words(smoke: bool) -> list[str]:
    return [f"w{i}" for i in range(WORDS["smoke" if smoke else "real"])]


def digest(obj: Any) -> str:
    """Names a cached model or data set, and tells results measured alike from the rest."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


def model_config(kind: str, layers: int, smoke: bool) -> dict:
    shape = (SMOKE_SHAPES if smoke else SHAPES)[kind]
    if kind in VL:
        text = {**shape.get("text_config", {}), "num_hidden_layers": layers}
        if kind == "vl_next":  # Qwen3.5's: every 4th layer full attention, the last one too in a short cut
            text["layer_types"] = _full_every(4, layers, "linear_attention")
        if kind == "gemma_vl":  # Gemma 3's: every 6th layer global (tiny.py's shape has its own for 4 layers)
            text["layer_types"] = _full_every(6, layers, "sliding_attention", last=False)
        if kind == "gemma4_vl":
            text["layer_types"] = _full_every(6, layers, "sliding_attention")
        return {**shape, "text_config": text, "num_hidden_layers": layers}
    if kind in ("gemma4", "gemma4_moe"):  # Gemma 4's: every 6th layer full attention, the last one too
        shape = {**shape, "layer_types": _full_every(6, layers, "sliding_attention")}
    if kind == "gemma4_e2b":  # every 5th layer full attention, the last one too; sharing from a full layer on
        shape = {**shape, "layer_types": _full_every(5, layers, "sliding_attention"),
                 "num_kv_shared_layers": min(layers * 20 // 35, layers - 5)}
    if kind == "next":  # Qwen3-Next's pattern (every 4th layer full attention), the last layer full in a short cut
        shape = {**shape, "layer_types": _full_every(4, layers, "linear_attention")}
    return {**shape, "num_hidden_layers": layers}


def _full_every(every: int, layers: int, other: str, last: bool = True) -> list[str]:
    """A layer pattern: every ``every``-th layer full attention, and with ``last`` the last one too (a short cut of
    the model keeps one), the others ``other``."""
    return ["full_attention" if (i + 1) % every == 0 or (last and i == layers - 1) else other for i in range(layers)]


def prepare_model(config: dict, smoke: bool, cache: str) -> str:
    """A random-weight HF model (bf16; fp32 in smoke) with a word-level tokenizer, saved once per shape."""
    from llamafactory_mca.tools.tiny import corpus, save_tiny_tokenizer

    name = f"model-{config['model_type']}-{config['num_hidden_layers']}l-{digest([config, smoke])}"
    path = os.path.join(cache, name)
    if os.path.isfile(os.path.join(path, ".complete")):
        return path
    spec = os.path.join(cache, f"{os.path.basename(path)}.json")
    os.makedirs(cache, exist_ok=True)
    with open(spec, "w", encoding="utf-8") as f:
        json.dump({"config": config, "dtype": "float32" if smoke else "bfloat16", "dir": path}, f)
    print(f"[e2e] building {os.path.basename(path)} ...", flush=True)
    subprocess.run([sys.executable, os.path.abspath(__file__), spec], check=True,
                   env={**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if smoke else {})})
    if "text_config" not in config and config["model_type"] not in VL_TEMPLATE:  # VL: saved with its processor
        save_tiny_tokenizer(path, texts=[" ".join(_words(smoke))] + corpus())
    open(os.path.join(path, ".complete"), "w").close()
    return path


def _make_model(spec_path: str) -> None:
    """Subprocess: build on the GPU when there is one (fast init), save, exit (frees the GPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    if spec["config"]["model_type"] in VL_TEMPLATE:
        from llamafactory_mca.tools.tiny import corpus, save_tiny_vl_model

        words = [f"w{i}" for i in range(WORDS["smoke" if spec["dtype"] == "float32" else "real"])]
        save_tiny_vl_model(spec["config"]["model_type"], spec["dir"], texts=[" ".join(words)] + corpus(),
                           dtype=getattr(torch, spec["dtype"]), text_config=spec["config"].get("text_config"),
                           vision_config=spec["config"].get("vision_config"),
                           mm_tokens_per_image=spec["config"].get("mm_tokens_per_image"))
        return
    config = AutoConfig.for_model(**spec["config"])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec["dtype"]))
    model.save_pretrained(spec["dir"])
    if getattr(config, "num_nextn_predict_layers", 0):
        from llamafactory_mca.tools.tiny import add_mtp_layers

        del model
        add_mtp_layers(config, spec["dir"], getattr(torch, spec["dtype"]),
                       device="cuda" if torch.cuda.is_available() else "cpu")


def row_lengths(lengths: tuple, n: int, rng: np.random.Generator) -> np.ndarray:
    kind, low, high = lengths
    if kind == "loguniform":
        return np.exp(rng.uniform(np.log(low), np.log(high), n)).astype(int)
    return rng.integers(low, high + 1, n)


def mean_length(lengths: tuple) -> float:
    kind, low, high = lengths
    return (high - low) / math.log(high / low) if kind == "loguniform" else (low + high) / 2


TEMPLATE_MARGIN = 24  # the chat template's tokens around prompt and answer stay inside cutoff_len


def prepare_dataset(w: Workload, steps: int, smoke: bool, cache: str) -> str:
    """Alpaca rows of words w0..wN: Zipf-distributed with a deterministic-bigram half, so the loss falls."""
    from llamafactory_mca.tools.tiny import write_alpaca_dataset

    high = min(w.lengths[2], w.cutoff - TEMPLATE_MARGIN)
    lengths = (w.lengths[0], min(w.lengths[1], high), high)
    per_step = max(r.gpus * r.grad_accum * (r.micro_batch * w.cutoff / mean_length(lengths) if r.packing
                                            else r.micro_batch) for r in w.runs)
    n_rows = max(16, int(1.3 * per_step * steps) + 8)
    path = os.path.join(cache, f"data-{w.name}-{digest([lengths, n_rows, w.cutoff, smoke])}")
    if os.path.isfile(os.path.join(path, ".complete")):
        return os.path.join(path, "data")
    rng = np.random.default_rng(1234)
    words = np.array(_words(smoke))
    vocab = len(words)
    probs = 1.0 / (np.arange(vocab) + 10.0)
    probs /= probs.sum()
    rows = []
    for length in row_lengths(lengths, n_rows, rng):
        ids = rng.choice(vocab, size=int(length), p=probs)
        follow = rng.random(int(length)) < 0.5
        for i in np.flatnonzero(follow[1:]) + 1:
            ids[i] = (ids[i - 1] * 31 + 7) % vocab
        prompt = max(1, int(length) // 4)
        rows.append({"instruction": " ".join(words[ids[:prompt]]), "input": "",
                     "output": " ".join(words[ids[prompt:]])})
    if w.model in VL:
        _with_images(path, rows, image_side(w.model, smoke), rng)
    else:
        write_alpaca_dataset(path, 0, name="e2e", rows=rows)
    open(os.path.join(path, ".complete"), "w").close()
    return os.path.join(path, "data")


def _with_images(path: str, rows: list[dict], side: int, rng: np.random.Generator) -> None:
    """The rows as sharegpt conversations, each asking about one random side x side image."""
    from PIL import Image  # Pillow: the VL workloads' need alone

    data = os.path.join(path, "data")
    os.makedirs(data, exist_ok=True)
    out = []
    for i, row in enumerate(rows):
        image = os.path.join(data, f"{i}.png")
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(image)
        out.append({"messages": [{"role": "user", "content": "<image>" + row["instruction"]},
                                 {"role": "assistant", "content": row["output"]}], "images": [image]})
    with open(os.path.join(data, "e2e.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)
    info = {"e2e": {"file_name": "e2e.json", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "images": "images"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant"}}}
    with open(os.path.join(data, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f)


if __name__ == "__main__":  # prepare_model's subprocess
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _make_model(sys.argv[1])
