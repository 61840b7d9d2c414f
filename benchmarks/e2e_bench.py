"""End to end: LLaMA-Factory's default path vs llamafactory_mca on the same model, data, batch and steps.

Every run is a subprocess launched as LLaMA-Factory's launcher would (torchrun under ``USE_MCA=1`` or with more
than one GPU); ``_e2e_entry.py`` stands in for ``launcher.py`` to time steps and count real tokens. Results merge
into ``--out``/e2e.json and e2e.md, so one workload per invocation builds one table:

    python benchmarks/e2e_bench.py --workloads dense --out benchmarks/results
    python benchmarks/e2e_bench.py --smoke --workloads all          # tiny shapes on CPU: checks the harness

See benchmarks/README.md for the workloads, the columns and the targets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(ROOT, "benchmarks", "_e2e_entry.py")
sys.path.insert(0, ROOT)

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
VL = {"vl": QWEN2_5_VL_7B, "vl_moe": QWEN3_VL_30B_A3B, "vl_next": QWEN3_5_35B_A3B}
VL_TEMPLATE = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl_moe": "qwen3_vl_nothink", "qwen3_5_moe": "qwen3_5_nothink"}
SMOKE_SHAPES |= {kind: dict(model_type=shape["model_type"]) for kind, shape in VL.items()}  # tiny.py's shapes
# GLM-4.5-Air as released, with its multi-token-prediction layer (an MoE layer): ours trains it, LLaMA-Factory's
# default path drops it (transformers has no MTP)
SMOKE_SHAPES["glm_mtp"] = {**SMOKE_SHAPES["glm"], "num_nextn_predict_layers": 1}
SHAPES = {"dense": QWEN3_1_7B, "dense8b": QWEN3_8B, "moe": QWEN3_30B_A3B, "glm": GLM_4_5_AIR,
          "glm_mtp": {**GLM_4_5_AIR, "num_nextn_predict_layers": 1}, "moonlight": MOONLIGHT, "next": QWEN3_NEXT_80B,
          **VL}
LABELS = {"dense": "Qwen3-1.7B shape", "dense8b": "Qwen3-8B shape", "moe": "Qwen3-30B-A3B shape",
          "glm": "GLM-4.5-Air shape", "glm_mtp": "GLM-4.5-Air shape with its MTP layer",
          "moonlight": "Moonlight-16B-A3B shape (DeepSeek-V3 architecture)",
          "next": "Qwen3-Next-80B-A3B shape",
          "vl": "Qwen2.5-VL-7B shape",
          "vl_moe": "Qwen3-VL-30B-A3B shape",
          "vl_next": "Qwen3.5-35B-A3B shape"}
MOE_KINDS = ("moe", "vl_moe", "vl_next", "glm", "glm_mtp", "moonlight", "next")


def image_side(kind: str, smoke: bool) -> int:
    """Pixels per image side: 32 x 32 patches (256 tokens after the 2 x 2 merge); smoke: tiny.py's 32 pixels."""
    return 32 if smoke else 32 * VL[kind]["vision_config"]["patch_size"]


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
    # LLaMA-Factory's fastest option a user can pick here: Liger kernels, gradient checkpointing off where it fits
    liger_gc = dict(enable_liger_kernel=True)
    liger = dict(liger_gc, disable_gradient_checkpointing=True)
    varlen_runs = (_pair(1, 4, "1 GPU, padded", packing=False, micro_batch=2, suffix="_nopack")
                   + _pair(1, 8, "1 GPU, packed", suffix="_pack"))
    found = [
        Workload("dense", "dense", cut, packed,
                 _pair(1, 8, "1 GPU")
                 + [Run("lf_liger", "lf", 1, True, 1, 8, "1 GPU, Liger, no checkpointing", liger)],
                 about=f"{cut}-token packed micro-batches, global batch 8; `lf_liger`: LLaMA-Factory with "
                       "`enable_liger_kernel` and gradient checkpointing off"),
        Workload("dp2", "dense", cut, packed, _pair(2, 4, "DP2", lf_layout="DDP, 2 GPUs"),
                 about=f"{cut}-token packed micro-batches, global batch 8 (dp 2 x grad accum 4)"),
        Workload("moe", "moe", cut, packed,
                 _pair(1, 8, "1 GPU") + [Run("ours_recompute", "ours", 1, True, 1, 8, "1 GPU, recompute full",
                                             recompute),
                                         Run("lf_liger", "lf", 1, True, 1, 8, "1 GPU, Liger, checkpointing",
                                             liger_gc)],
                 about=f"{cut}-token packed micro-batches, global batch 8; LLaMA-Factory recomputes by default "
                       "(gradient checkpointing), so `ours_recompute` is the like-for-like memory comparison; "
                       "`lf_liger`: LLaMA-Factory with `enable_liger_kernel`"),
        Workload("moe_ep2", "moe", cut, packed, _pair(2, 4, "EP2", {"expert_model_parallel_size": 2},
                                                      lf_layout="DDP, 2 GPUs"),
                 about=f"{cut}-token packed micro-batches, global batch 8 (dp 2 x grad accum 4)"),
        Workload("long", "dense", long_cut, ("uniform", int(long_cut * 0.9), long_cut),
                 [Run("lf", "lf", 1, False, 1, 2, "1 GPU, gradient checkpointing (LF default)"),
                  Run("lf_liger", "lf", 1, False, 1, 2, "1 GPU, Liger, gradient checkpointing", liger_gc),
                  Run("ours", "ours", 1, True, 1, 2, "1 GPU, recompute full", recompute),
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
                 + [Run("ours_pack", "ours", 1, True, 1, 8, "1 GPU, packed")],
                 about=f"{LABELS[kind]} sft: one {image_side(kind, smoke)}-pixel image per row (256 tokens; the tower "
                       f"frozen, LLaMA-Factory's default) and log-uniform {max(32 // k, 4)}..{cut // 2} text tokens; "
                       "padded: 2 rows x 4, packed: 1 pack x 8. MFU: the language model only")
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
                  Run("ours_mb2", "ours", 1, True, 2, 4, "1 GPU")],
                 steps=6, warmup=2, layers=None if smoke else 48, tuning=lora,
                 about=lora_about.format(cut=cut) + "; `ours_experts` also adapts every expert (not possible in "
                       "LLaMA-Factory's default path); `*_mb2`: 2 packs of 4096 tokens per micro-batch x 4 (the same "
                       "global batch)"),
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
        Workload("lora_dense", "dense8b", cut, packed,
                 _pair(1, 8, "1 GPU", lf_layout="1 GPU, gradient checkpointing (LF default)")
                 + [Run("ours_recompute", "ours", 1, True, 1, 8, "1 GPU, recompute full", recompute)],
                 steps=8, warmup=2, layers=None if smoke else 36, tuning=lora, about=lora_about.format(cut=cut)),
    ]
    if smoke:
        for w in found:
            w.steps, w.warmup = 4, 1
    return {w.name: w for w in found}


# ---- assets: tokenizer, random-weight model, synthetic SFT data (cached under --work) -----------------------------
WORDS = {"smoke": 200, "real": 8000}


def _words(smoke: bool) -> list[str]:
    return [f"w{i}" for i in range(WORDS["smoke" if smoke else "real"])]


def _key(obj: Any) -> str:
    import hashlib

    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


def model_config(kind: str, layers: int, smoke: bool) -> dict:
    shape = (SMOKE_SHAPES if smoke else SHAPES)[kind]
    if kind in VL:
        text = {**shape.get("text_config", {}), "num_hidden_layers": layers}
        if kind == "vl_next":  # every 4th layer full attention, the last one too in a short cut
            text["layer_types"] = _hybrid_pattern(layers)
        return {**shape, "text_config": text, "num_hidden_layers": layers}
    if kind == "next":  # Qwen3-Next's pattern (every 4th layer full attention), the last layer full in a short cut
        shape = {**shape, "layer_types": _hybrid_pattern(layers)}
    return {**shape, "num_hidden_layers": layers}


def _hybrid_pattern(layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 or i == layers - 1 else "linear_attention" for i in range(layers)]


def prepare_model(config: dict, smoke: bool, cache: str) -> str:
    """A random-weight HF model (bf16; fp32 in smoke) with a word-level tokenizer, saved once per shape."""
    from llamafactory_mca.tiny import corpus, save_tiny_tokenizer

    path = os.path.join(cache, f"model-{config['model_type']}-{config['num_hidden_layers']}l-{_key([config, smoke])}")
    if os.path.isfile(os.path.join(path, ".complete")):
        return path
    spec = os.path.join(cache, f"{os.path.basename(path)}.json")
    os.makedirs(cache, exist_ok=True)
    with open(spec, "w", encoding="utf-8") as f:
        json.dump({"config": config, "dtype": "float32" if smoke else "bfloat16", "dir": path}, f)
    print(f"[e2e] building {os.path.basename(path)} ...", flush=True)
    subprocess.run([sys.executable, os.path.abspath(__file__), "--_make-model", spec], check=True,
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
        from llamafactory_mca.tiny import corpus, save_tiny_vl_model

        words = [f"w{i}" for i in range(WORDS["smoke" if spec["dtype"] == "float32" else "real"])]
        save_tiny_vl_model(spec["config"]["model_type"], spec["dir"], texts=[" ".join(words)] + corpus(),
                           dtype=getattr(torch, spec["dtype"]), text_config=spec["config"].get("text_config"),
                           vision_config=spec["config"].get("vision_config"))
        return
    config = AutoConfig.for_model(**spec["config"])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec["dtype"]))
    model.save_pretrained(spec["dir"])
    if getattr(config, "num_nextn_predict_layers", 0):
        from llamafactory_mca.tiny import add_mtp_layers

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
    from llamafactory_mca.tiny import write_alpaca_dataset

    high = min(w.lengths[2], w.cutoff - TEMPLATE_MARGIN)
    lengths = (w.lengths[0], min(w.lengths[1], high), high)
    per_step = max(r.gpus * r.grad_accum * (r.micro_batch * w.cutoff / mean_length(lengths) if r.packing
                                            else r.micro_batch) for r in w.runs)
    n_rows = max(16, int(1.3 * per_step * steps) + 8)
    path = os.path.join(cache, f"data-{w.name}-{_key([lengths, n_rows, w.cutoff, smoke])}")
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
    from PIL import Image

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


# ---- machine and versions -----------------------------------------------------------------------------------------
def machine_info(smoke: bool) -> dict:
    probe = ("import json, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; "
             "print(json.dumps({'count': n, 'names': [torch.cuda.get_device_name(i) for i in range(n)], "
             "'memory_gib': [round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1) for i in range(n)]}))")
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if smoke else {})}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    gpus = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"count": 0, "names": []}
    if not gpus["count"]:
        gpus.update(names=[], device=f"CPU ({os.cpu_count()} cores, gloo)")
    else:
        gpus["device"] = f"{gpus['count']} x {gpus['names'][0]}"
    return gpus


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "megatron-core", "llamafactory", "llamafactory-mca", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def peak_flops_for(name: str) -> float | None:
    from llamafactory_mca.trainer.metrics import PEAK_BF16_FLOPS

    for key, value in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return value
    return None


# ---- one run ------------------------------------------------------------------------------------------------------
def recipe(w: Workload, run: Run, model_dir: str, data_dir: str, out_dir: str, steps: int, args) -> dict:
    r = dict(model_name_or_path=model_dir, stage="sft", do_train=True, finetuning_type="full", dataset="e2e",
             dataset_dir=data_dir, cutoff_len=w.cutoff,
             template=VL_TEMPLATE[VL[w.model]["model_type"]] if w.model in VL else "qwen3_nothink",
             output_dir=out_dir,
             overwrite_output_dir=True, per_device_train_batch_size=run.micro_batch,
             gradient_accumulation_steps=run.grad_accum, max_steps=steps, learning_rate=args.lr,
             lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
             save_strategy="no", report_to="none", seed=42, disable_tqdm=True, plot_loss=False,
             preprocessing_num_workers=1 if args.smoke else 4)
    r.update({"use_cpu": True} if args.smoke else {"bf16": True})
    r.update(w.tuning)
    if run.path == "lf":
        r["flash_attn"] = "sdpa"
        if run.packing:
            r["neat_packing"] = True
        # no moe_aux_loss_coef: LLaMA-Factory's default trains MoE without the load-balancing loss (and with it,
        # neat_packing's 4-D mask breaks transformers' load_balancing_loss_func); ours keeps the config's 0.001
    else:
        r.update(sequence_packing=run.packing, use_distributed_optimizer=True, overlap_grad_reduce=True,
                 overlap_param_gather=True)
        if w.model in MOE_KINDS:
            r.update(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
    r.update(run.extra)
    return r


def _has_liger() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_devices(n: int, smoke: bool) -> str:
    if smoke:
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(n)]
    return ",".join(ids[:n])


def launch(run: Run, recipe_path: str, run_dir: str, timeout: int, smoke: bool) -> tuple[str, float]:
    """Start the run as LLaMA-Factory's launcher would; returns (status, seconds)."""
    torchrun = run.path == "ours" or run.gpus > 1  # the launcher forces torchrun under USE_MCA=1
    metrics = os.path.join(run_dir, "metrics")
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node_rank", "0",
               "--nproc_per_node", str(run.gpus), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               ENTRY, recipe_path]
    else:
        cmd = [sys.executable, ENTRY, recipe_path]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("USE_MCA", "LLAMAFACTORY_MCA_", "E2E_BENCH_"))}
    env.update(NPROC_PER_NODE=str(run.gpus), CUDA_VISIBLE_DEVICES=_visible_devices(run.gpus, smoke),
               HF_DATASETS_CACHE=os.path.join(run_dir, "datasets_cache"),  # every run tokenizes from scratch
               E2E_BENCH_OUT=metrics, E2E_BENCH_EXIT="1", E2E_BENCH_PACKED="1" if run.packing else "0")
    if run.path == "ours":
        env["USE_MCA"] = "1"
    if smoke:  # one BLAS thread per process: CPU numbers only check the harness, keep them steady and comparable
        env["OMP_NUM_THREADS"] = "1"
    if torchrun:  # what LLaMA-Factory's launcher adds for torchrun (OPTIM_TORCH, on by default)
        env.update(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", TORCH_NCCL_AVOID_RECORD_STREAMS="1")
    with open(recipe_path, encoding="utf-8") as f:
        settings = f.read()
    with open(os.path.join(run_dir, "command.txt"), "w", encoding="utf-8") as f:
        f.write(" ".join(f"{k}={env[k]}" for k in ("USE_MCA", "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES") if k in env)
                + " " + " ".join(cmd) + "\n" + settings)
    start = time.time()
    env["E2E_BENCH_T0"] = repr(start)
    with open(os.path.join(run_dir, "log.txt"), "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return "timeout", time.time() - start
    return ("ok" if rc == 0 else f"failed (exit {rc})"), time.time() - start


def _stop(proc: subprocess.Popen) -> None:
    """End the run we started: its process group (torchrun and its ranks), TERM then KILL."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _log_problem(run_dir: str) -> tuple[bool, str]:
    """(out of memory?, the most telling error line) from the run's log."""
    try:
        with open(os.path.join(run_dir, "log.txt"), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False, ""
    import re

    oom = any("out of memory" in line.lower() or "OutOfMemoryError" in line for line in lines)
    raised = re.compile(r"^\s*(\[rank\d+\]:\s*)?([\w.]*(Error|Exception)|Traceback)\b")
    errors = [line.strip() for line in lines if raised.match(line) and "ChildFailedError" not in line
              and not line.strip().startswith("Traceback")]
    return oom, (errors[-1] if errors else (lines[-1].strip() if lines else ""))[:300]


def summarize(run_dir: str, run: Run, warmup: int, flops_config, peak: float | None) -> dict:
    """Throughput, MFU, memory, time to first step and losses from the ranks' files."""
    from llamafactory_mca.trainer.metrics import flops_per_sequence_set

    ranks = []
    metrics = os.path.join(run_dir, "metrics")
    for name in sorted(os.listdir(metrics)) if os.path.isdir(metrics) else []:
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(metrics, name), encoding="utf-8") as f:
                ranks.append(json.load(f))
    if not ranks:
        return {}
    first = min(ranks, key=lambda r: r["rank"])
    steps = {s["step"]: dict(s) for s in first["steps"] if "t_end" in s}
    if first["token_scope"] == "rank":  # LLaMA-Factory path: add the ranks' tokens and sequences
        flops_config = flops_config.without_mtp()  # transformers drops multi-token prediction: it does not train it
        for s in steps.values():
            s["tokens"], s["flops"] = 0, 0.0
        for r in ranks:
            for s in r["steps"]:
                if s["step"] in steps and "tokens" in s:
                    steps[s["step"]]["tokens"] += s["tokens"]
                    steps[s["step"]]["flops"] += flops_per_sequence_set(flops_config.transformer,
                                                                         flops_config.vocab_size, s["seqlens"])
    result: dict[str, Any] = {
        "steps_done": len(steps),
        "first_step_s": round(max(r["first_step_s"] or 0.0 for r in ranks), 1) if first["first_step_s"] else None,
        "peak_memory_gib": round(max(r["peak_memory_gib"] for r in ranks), 2) or None,
        "peak_reserved_gib": round(max(r["peak_reserved_gib"] for r in ranks), 2) or None,
        "losses": [round(steps[k]["loss"], 4) if "loss" in steps[k] else None for k in sorted(steps)],
    }
    window = [k for k in sorted(steps) if k > warmup and "tokens" in steps[k]]
    if warmup in steps and window:
        seconds = steps[window[-1]]["t_end"] - steps[warmup]["t_end"]
        tokens = sum(steps[k]["tokens"] for k in window)
        flops = sum(steps[k]["flops"] for k in window)
        result.update(measured_steps=len(window), seconds=round(seconds, 3), real_tokens=int(tokens),
                      tokens_per_second_per_gpu=round(tokens / seconds / run.gpus, 1),
                      mfu=round(flops / seconds / run.gpus / peak, 4) if peak else None,
                      step_seconds=round(seconds / len(window), 3))
        reported = [steps[k].get("self_reported", {}) for k in window]
        keys = [key for key in ("tokens_per_second_per_gpu", "mfu") if any(key in r for r in reported)]
        if keys:  # ours: McaTrainer's own log line (timed over train_step only), for cross-checking
            result["self_reported"] = {key: round(float(np.mean([r[key] for r in reported if key in r])), 4)
                                       for key in keys}
    return result


def run_workload(w: Workload, args, info: dict, save) -> dict:
    """Every run of ``w``; ``save(partial result)`` after each, so a cut-off invocation keeps what it measured."""
    from llamafactory_mca.models.auto import AutoConfig

    steps = args.steps or w.steps
    warmup = min(args.warmup if args.warmup is not None else w.warmup, steps - 1)
    layers = args.layers or w.layers or (2 if args.smoke else 28 if w.model == "dense" else 8 if w.model == "vl" else
                                         8 if min(info.get("memory_gib") or [0]) >= 120 else 4)
    config = model_config(w.model, layers, args.smoke)
    work = os.path.join(args.work, "smoke" if args.smoke else "gpu")
    cache = os.path.join(work, "cache")
    model_dir = prepare_model(config, args.smoke, cache)
    data_dir = prepare_dataset(w, steps, args.smoke, cache)
    flops_config = AutoConfig.from_pretrained(model_dir)
    peak = peak_flops_for(info["names"][0]) if info["names"] else None
    settings = {"model": ("tiny stand-in for " if args.smoke else "") + LABELS[w.model], "layers": layers,
                "cutoff_len": w.cutoff, "lengths": list(w.lengths),
                "steps": steps, "warmup": warmup, "lr": args.lr, "about": w.about, "smoke": args.smoke,
                "precision": "fp32 (CPU)" if args.smoke else "bf16", "peak_flops": peak,
                "comparable": _key([config, w.cutoff, list(w.lengths), steps, args.lr, args.smoke,
                                    info["names"][:1]])}
    runs = {}
    result = {"settings": settings, "machine": info, "versions": versions(), "runs": runs}
    for run in w.runs:
        if (args.paths and run.path not in args.paths) or (args.runs and run.name not in args.runs):
            continue
        record = {"path": run.path, "gpus": run.gpus, "layout": run.layout, "packing": run.packing,
                  "micro_batch": run.micro_batch, "grad_accum": run.grad_accum}
        if run.extra.get("enable_liger_kernel") and (args.smoke or not _has_liger()):
            record["status"] = "skipped: Liger kernels need a GPU and liger-kernel installed"
            runs[run.name] = record
            print(f"[e2e] {w.name}/{run.name}: {record['status']}", flush=True)
            continue
        if run.gpus > args.gpus:
            record["status"] = f"skipped: needs {run.gpus} GPUs, {args.gpus} available"
            runs[run.name] = record
            print(f"[e2e] {w.name}/{run.name}: {record['status']}", flush=True)
            continue
        run_dir = os.path.join(work, "runs", w.name, run.name)
        if os.path.isdir(run_dir):
            import shutil

            shutil.rmtree(run_dir)
        os.makedirs(run_dir)
        recipe_path = os.path.join(run_dir, "recipe.yaml")
        import yaml

        with open(recipe_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(recipe(w, run, model_dir, data_dir, os.path.join(run_dir, "output"), steps, args), f)
        print(f"[e2e] {w.name}/{run.name}: {run.layout}, {run.gpus} x {'GPU' if not args.smoke else 'CPU process'}, "
              f"log {os.path.relpath(os.path.join(run_dir, 'log.txt'))}", flush=True)
        status, seconds = launch(run, recipe_path, run_dir, args.timeout, args.smoke)
        record.update(summarize(run_dir, run, warmup, flops_config, peak))
        oom, problem = _log_problem(run_dir)
        if status != "ok":
            record["error"] = problem
            status = "OOM" if oom else status
        elif record.get("steps_done", 0) < steps:
            status = "incomplete"
        record.update(status=status, wall_s=round(seconds, 1),
                      log=os.path.relpath(os.path.join(run_dir, "log.txt"), args.work))  # under --work
        runs[run.name] = record
        print(f"[e2e] {w.name}/{run.name}: {_one_line(record)} ({seconds:.0f} s)", flush=True)
        save(result | {"finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    return result | {"finished": time.strftime("%Y-%m-%d %H:%M:%S")}


def _one_line(r: dict) -> str:
    parts = [r["status"]]
    if r.get("tokens_per_second_per_gpu") is not None:
        parts.append(f"{r['tokens_per_second_per_gpu']:,.1f} tok/s/GPU")
    if r.get("mfu") is not None:
        parts.append(f"MFU {r['mfu']:.1%}")
    if r.get("peak_memory_gib"):
        parts.append(f"peak {r['peak_memory_gib']:.1f} GiB")
    if r.get("first_step_s") is not None:
        parts.append(f"first step {r['first_step_s']:.1f} s")
    losses = [x for x in r.get("losses", []) if x is not None]
    if losses:
        parts.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if r.get("error"):
        parts.append(r["error"][:160])
    return ", ".join(parts)


# ---- targets and the table ----------------------------------------------------------------------------------------
def _ok(run: dict | None) -> bool:
    return bool(run) and run.get("status") in ("ok", "timeout", "incomplete") and \
        bool(run.get("tokens_per_second_per_gpu"))


def _tail_loss(run: dict) -> float | None:
    losses = [x for x in run.get("losses", []) if x is not None]
    return float(np.mean(losses[-3:])) if losses else None


def _fastest(runs: dict, path: str) -> str | None:
    """The fastest finished run of a path among its plain runs and their micro-batch variants (``lf``, ``lf_mb2``,
    ``lf_liger``; ``ours``, ``ours_mb2``): the same training at the same global batch."""
    names = [n for n, r in runs.items() if _ok(r) and (n == path or n.startswith((f"{path}_mb", f"{path}_liger")))]
    return max(names, key=lambda n: runs[n]["tokens_per_second_per_gpu"], default=None)


def _ratio_target(label: str, num: dict | None, den: dict | None, goal: float | None, why_missing: str,
                  percent: bool = False) -> dict:
    """num / den of tokens/s/GPU against ``goal`` (None: shown for reference, no verdict)."""
    if not (_ok(num) and _ok(den)):
        return {"target": label, "measured": why_missing, "met": None}
    ratio = num["tokens_per_second_per_gpu"] / den["tokens_per_second_per_gpu"]
    return {"target": label, "measured": f"{ratio:.0%}" if percent else f"{ratio:.2f}x",
            "met": None if goal is None else ratio >= goal, "value": round(ratio, 4)}


def _loss_target(name_a: str, a: dict | None, name_b: str, b: dict | None, tol: float) -> dict | None:
    if not (a and b and _tail_loss(a) is not None and _tail_loss(b) is not None):
        return None
    la, lb = _tail_loss(a), _tail_loss(b)
    gap = abs(la - lb) / max(abs(la), 1e-9)
    return {"target": f"same training: loss of the last 3 steps within {tol:.0%} ({name_a} vs {name_b})",
            "measured": f"{la:.3f} vs {lb:.3f} ({gap:.1%})", "met": gap <= tol, "value": round(gap, 4)}


def _memory_target(name: str, ours: dict | None, lf: dict) -> dict | None:
    if ours is None:
        return None
    met, measured = None, "n/a (CPU or a run failed)"
    if ours.get("peak_memory_gib") and lf.get("peak_memory_gib"):
        met = ours["peak_memory_gib"] <= lf["peak_memory_gib"]
        measured = f"{ours['peak_memory_gib']:.1f} vs {lf['peak_memory_gib']:.1f} GiB"
    elif ours.get("peak_memory_gib") and lf.get("status") == "OOM":
        met, measured = True, f"{ours['peak_memory_gib']:.1f} GiB vs LLaMA-Factory OOM"
    return {"target": f"peak memory per GPU: {name} <= LLaMA-Factory (same micro-batch)", "measured": measured,
            "met": met}


def _curve_target(name_a: str, a: dict | None, name_b: str, b: dict | None, tol: float = 0.02) -> dict | None:
    """Step-by-step loss curves of two layouts agree within bf16 tolerance."""
    la, lb = (a or {}).get("losses") or [], (b or {}).get("losses") or []
    pairs = [(x, y) for x, y in zip(la, lb) if x is not None and y is not None]
    if not pairs:
        return None
    gap = max(abs(x - y) / max(abs(y), 1e-9) for x, y in pairs)
    return {"target": f"loss curve {name_a} = {name_b} within {tol:.0%} at every step",
            "measured": f"max gap {gap:.2%} over {len(pairs)} steps", "met": gap <= tol, "value": round(gap, 4)}


# tokens/s against LLaMA-Factory (dense, MoE, LoRA, ...) and MFU of our plain run
GOALS = {"dense": 3.0, "moe": 5.0, "lora_dense": 1.5, "lora_moe": 3.0, "glm_moe": 3.0, "glm_mtp": 3.0,
         "moonlight": 3.0}
MFU_GOALS = {"dense": 0.40, "moe": 0.25, "glm_moe": None, "glm_mtp": None, "moonlight": None}


def targets(name: str, data: dict, everything: dict, tol: float) -> list[dict]:
    runs = data["runs"]
    found: list[dict | None] = []

    def other(workload: str, run: str) -> tuple[dict | None, str]:
        ref = everything.get(workload)
        if not ref:
            return None, f"run `--workloads {workload}` for the 1-GPU reference"
        if ref["settings"]["comparable"] != data["settings"]["comparable"]:
            return None, f"`{workload}` was run with other shapes/steps; rerun it with the same flags"
        return ref["runs"].get(run), f"`{workload}/{run}` has no throughput"

    if name in GOALS:
        goal = GOALS[name]
        found.append(_ratio_target(f"tokens/s: ours >= {goal:g}x LLaMA-Factory", runs.get("ours"), runs.get("lf"),
                                   goal, "needs both runs"))
        best, best_lf = _fastest(runs, "ours"), _fastest(runs, "lf")
        if (best, best_lf) != ("ours", "lf") and best and best_lf:  # LF's Liger row, other micro-batch sizes
            found.append(_ratio_target(f"tokens/s: the faster of ours ({best}) >= {goal:g}x the faster of "
                                       f"LLaMA-Factory ({best_lf})", runs[best], runs[best_lf], goal, ""))
        if name.startswith("lora"):  # LLaMA-Factory recomputes by default: like for like is ours with recompute
            found.append(_memory_target("ours_recompute", runs.get("ours_recompute"), runs.get("lf") or {}))
        elif MFU_GOALS[name] is not None:
            mfu, goal = (runs.get("ours") or {}).get("mfu"), MFU_GOALS[name]
            found.append({"target": f"MFU (ours) >= {goal:.0%}", "measured": f"{mfu:.1%}" if mfu is not None else
                          "n/a", "met": (mfu >= goal) if mfu is not None else None})
        if name == "moe":
            for run in ("ours", "ours_recompute"):
                found.append(_memory_target(run, runs.get(run), runs.get("lf") or {}))
        found.append(_loss_target("ours", runs.get("ours"), "LF", runs.get("lf"), tol))
    elif name in ("dp2", "moe_ep2"):
        base, layout = ("dense", "DP2") if name == "dp2" else ("moe", "EP2")
        ref, why = other(base, "ours")
        found.append(_ratio_target(f"tokens/s/GPU: ours {layout} >= 90% of ours on 1 GPU", runs.get("ours"), ref, 0.9,
                                   why, percent=True))
        ref, why = other(base, "lf")
        found.append(_ratio_target("(for reference) LLaMA-Factory DDP2 per GPU vs its 1 GPU", runs.get("lf"), ref,
                                   None, why, percent=True))
        if name == "moe_ep2":
            found.append(_memory_target("ours EP2", runs.get("ours"), runs.get("lf") or {}))
        found.append(_loss_target("ours", runs.get("ours"), "LF", runs.get("lf"), tol))
    elif name == "long":
        found.append(_ratio_target("tokens/s/GPU: ours CP2 >= 90% of ours on 1 GPU", runs.get("ours_cp2"),
                                   runs.get("ours"), 0.9, "needs both runs", percent=True))
        lf = runs.get("lf") or {}
        best_lf = _fastest(runs, "lf")
        found.append(_ratio_target(f"tokens/s: ours 1 GPU >= 2.5x LLaMA-Factory's fastest that fits ({best_lf})",
                                   runs.get("ours"), runs.get(best_lf) if best_lf else None, 2.5,
                                   f"LLaMA-Factory: {lf.get('status', 'not run')}"))
        found.append(_loss_target("ours", runs.get("ours"), "LF", lf, tol))
        found.append(_loss_target("ours CP2", runs.get("ours_cp2"), "ours", runs.get("ours"), tol))
    elif name == "layouts":
        for run in ("ours_tp2", "ours_pp2"):
            found.append(_curve_target(run, runs.get(run), "ours (1 GPU)", runs.get("ours")))
    elif name == "qwen3_next":
        for mode in ("pack", "nopack"):
            found.append(_ratio_target(f"tokens/s: ours >= 3x LLaMA-Factory ({mode.replace('no', 'not ')}ed)",
                                       runs.get(f"ours_{mode}"), runs.get(f"lf_{mode}"), 3.0, "needs both runs"))
            found.append(_loss_target(f"ours {mode}", runs.get(f"ours_{mode}"), f"LF {mode}", runs.get(f"lf_{mode}"),
                                      tol))
    elif name == "qwen3_5":  # measured, no target set: ours trains the MTP layer as well, unless told not to
        for run in ("ours_nopack", "ours_nopack_no_mtp", "ours_pack"):
            found.append(_ratio_target(f"(for reference) tokens/s: {run} vs LLaMA-Factory padded", runs.get(run),
                                       runs.get("lf_nopack"), None, "needs both runs"))
        found.append(_loss_target("ours padded, no MTP", runs.get("ours_nopack_no_mtp"), "LF padded",
                                  runs.get("lf_nopack"), tol))
    elif name.startswith("varlen"):
        found.append(_ratio_target("effective tokens/s: ours packed >= 1.5x ours padded", runs.get("ours_pack"),
                                   runs.get("ours_nopack"), 1.5, "needs both runs"))
        found.append(_ratio_target("effective tokens/s: ours packed >= 1.5x LLaMA-Factory packed (neat_packing)",
                                   runs.get("ours_pack"), runs.get("lf_pack"), 1.5, "needs both runs"))
        found.append(_ratio_target("(for reference) LLaMA-Factory packed vs padded", runs.get("lf_pack"),
                                   runs.get("lf_nopack"), None, "needs both runs"))
        found.append(_loss_target("ours packed", runs.get("ours_pack"), "LF packed", runs.get("lf_pack"), tol))
        found.append(_loss_target("ours padded", runs.get("ours_nopack"), "LF padded", runs.get("lf_nopack"), tol))
    return [t for t in found if t]


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(results: dict) -> str:
    lines = ["# End-to-end: LLaMA-Factory's default path vs llamafactory_mca", "",
             ("Same model shape, data, cutoff, global batch, learning rate and steps per workload. tokens/s/GPU: real "
              "(non-pad) tokens per second per GPU over the steps after warm-up, step end to step end (data loading "
              "included). MFU: model FLOPs (`flops_per_sequence_set`: dense, MoE active parameters, causal attention; "
              "padded rows at their padded length) / time / GPUs / bf16 peak. Peak memory: "
              "`torch.cuda.max_memory_allocated()` during training, max over ranks. First step: launch to the end of "
              "step 1 (imports, tokenization, model load included). Loss: step 1 -> last step. See "
              "benchmarks/README.md."), ""]
    for name, data in results["workloads"].items():
        s, m, v = data["settings"], data["machine"], data["versions"]
        peak = f", bf16 peak {s['peak_flops'] / 1e12:.0f} TFLOPS" if s["peak_flops"] else ""
        lines += [f"## {name}: {s['model']}, {s['layers']} layers; {s['about']}", "",
                  (f"{m['device']}{peak}; {s['precision']}; {s['steps']} steps ({s['warmup']} warm-up), lr "
                   f"{s['lr']:g} constant; torch {v['torch']} (CUDA {v['cuda']}), transformers {v['transformers']}, "
                   f"megatron-core {v['megatron-core']}, llamafactory {v['llamafactory']}, llamafactory-mca "
                   f"{v['llamafactory-mca']}; {data['finished']}"), "",
                  ("| run | path | layout | packing | micro-batch x accum | tokens/s/GPU | MFU | peak mem (GiB) "
                   "| first step (s) | loss first -> last | status |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for run_name, r in data["runs"].items():
            path = "LLaMA-Factory (HF Trainer, sdpa)" if r["path"] == "lf" else "llamafactory_mca"
            packing = ("neat_packing" if r["path"] == "lf" else "sequence_packing") if r["packing"] else "padded"
            losses = [x for x in r.get("losses", []) if x is not None]
            loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"
            tps = r.get("tokens_per_second_per_gpu")
            lines.append(f"| {run_name} | {path} | {r['layout']} | {packing} | {r['micro_batch']} x {r['grad_accum']} "
                         f"| {_cell(tps, ',.0f' if tps and tps >= 100 else ',.1f')} | {_cell(r.get('mfu'), '.1%')} "
                         f"| {_cell(r.get('peak_memory_gib'), '.1f')} | {_cell(r.get('first_step_s'), '.1f')} "
                         f"| {loss} | {r['status']} |")
        found = data.get("targets") or []
        if found:
            lines += ["", "| target | measured | |", "|---|---|---|"]
            for t in found:
                mark = "met" if t["met"] else "n/a" if t["met"] is None else "**missed**"
                lines.append(f"| {t['target']} | {t['measured']} | {mark} |")
        errors = [(n, r["error"]) for n, r in data["runs"].items() if r.get("error")]
        for run_name, error in errors:
            lines.append(f"\n`{run_name}`: {error}")
        lines.append("")
    return "\n".join(lines)


def write_results(out: str, new: dict, tol: float) -> dict:
    path = os.path.join(out, "e2e.json")
    results = {"workloads": {}}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    for name, data in new.items():
        before = results["workloads"].get(name)
        if before and before["settings"]["comparable"] == data["settings"]["comparable"]:
            # same shapes and steps: keep earlier runs this invocation did not redo (--paths, fewer GPUs)
            runs = dict(before["runs"])
            runs.update({k: r for k, r in data["runs"].items()
                         if not (r["status"].startswith("skipped") and k in runs)})
            data = data | {"runs": runs}
        results["workloads"][name] = data
    order = list(workloads(False))
    results["workloads"] = dict(sorted(results["workloads"].items(),
                                       key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    for name, data in results["workloads"].items():
        data["targets"] = targets(name, data, results["workloads"], tol)
    os.makedirs(out, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "e2e.md"), "w", encoding="utf-8") as f:
        f.write(markdown(results))
    return results


def main(argv: list | None = None) -> None:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--_make-model":
        return _make_model(sys.argv[2])
    names = list(workloads(False))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="dense", help=f"comma-separated: {','.join(names)} or all")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default 12; long, lora_dense 8; lora_moe 6)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps left out of the rates (default 4; long 3; lora_* 2)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default 28 for the dense model; MoE: 8 on >=120 GiB GPUs, else 4; "
                             "lora_moe 48, lora_dense 36: all)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--paths", default="lf,ours", help="which paths to run: lf,ours")
    parser.add_argument("--runs", default="", help="only these runs of the workloads, by name (default: all)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs available (default: all visible; smoke: 2)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per run before it is stopped")
    parser.add_argument("--loss-tol", type=float, default=0.05, help="relative gap allowed between final losses")
    parser.add_argument("--out", default=None, help="e2e.json + e2e.md merge here (default benchmarks/results; "
                                                   "smoke: benchmarks/results/smoke)")
    parser.add_argument("--work", default=os.path.join(ROOT, "benchmarks", "runs", "e2e"),
                        help="models, data and run logs (cached between invocations)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (gloo, fp32): checks the harness")
    parser.add_argument("--merge", nargs="+", default=None, metavar="E2E_JSON",
                        help="run nothing: merge these e2e.json files (later ones win) into --out, redraw the table")
    args = parser.parse_args(argv)
    if args.merge:
        args.out = args.out or os.path.join(ROOT, "benchmarks", "results")
        for path in args.merge:
            with open(path, encoding="utf-8") as f:
                results = write_results(args.out, json.load(f)["workloads"], args.loss_tol)
        print(markdown(results))
        return None
    chosen = names if args.workloads == "all" else [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {names}")
    args.paths = {p.strip() for p in args.paths.split(",") if p.strip()}
    args.runs = {r.strip() for r in args.runs.split(",") if r.strip()}
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", *(["smoke"] if args.smoke else []))
    info = machine_info(args.smoke)
    if not info["count"] and not args.smoke:
        parser.error("no CUDA GPU visible: the benchmark needs one (use --smoke to check the harness on CPU)")
    args.gpus = args.gpus or (2 if args.smoke else info["count"])
    specs = workloads(args.smoke)
    results = {}
    for name in chosen:
        def save(partial: dict, name: str = name) -> dict:
            return write_results(args.out, {name: partial}, args.loss_tol)

        results = save(run_workload(specs[name], args, info, save))
    print(markdown({"workloads": {n: results["workloads"][n] for n in chosen}}))
    print(f"[e2e] wrote {os.path.join(args.out, 'e2e.json')} and e2e.md")


if __name__ == "__main__":
    main()
