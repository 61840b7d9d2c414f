"""Tiny random models from the real ``transformers`` config classes, for tests, the demo and benchmarks.

Shapes are chosen to exercise what breaks: grouped-query attention, a vocabulary that is not a
multiple of 128 (padding), explicit head_dim, odd and even expert counts, tied and untied embeddings.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from ..models.families import get_family


BASE = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            initializer_range=0.05)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2, router_aux_loss_coef=0.0)

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(BASE),
    "llama3_tied": dict(BASE, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}, rope_theta=500000.0),
    # sliding windows shorter than the tests' sequences: on every layer (Mistral), on the last two of four (Qwen2's
    # max_window_layers), so a pipeline stage or virtual stage may hold both kinds
    "mistral": dict(BASE, sliding_window=8),
    "qwen2": dict(BASE, use_sliding_window=True, sliding_window=6, max_window_layers=2),
    "qwen3": dict(BASE, head_dim=24),
    "qwen2_moe": dict(BASE, **MOE, num_experts=4, shared_expert_intermediate_size=48, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(BASE, **MOE, num_experts=4, head_dim=16, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    # GLM-4.5's layout: layer 0 dense, then 4 routed experts in 2 groups (top-2 of them, from the best group),
    # one shared expert, q/k/v biases, qk-norm, RoPE on half of each head, a multi-token-prediction layer
    "glm4_moe": dict(BASE, **MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                     topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                     use_qk_norm=True, head_dim=16, partial_rotary_factor=0.5, num_nextn_predict_layers=1),
    # MiniMax-M2's layout: q/k norms across all heads, RoPE on half of each head, every layer 4 experts routed by
    # sigmoid scores with a correction bias on the MoE block
    "minimax_m2": dict(BASE, intermediate_size=32, num_experts_per_tok=2, router_aux_loss_coef=0.0,
                       num_local_experts=4, head_dim=16,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # DeepSeek-V3's layout on the same routing: multi-latent attention (q and kv low rank, RoPE on 4 of each head's
    # 12 q/k dims, value heads of 6), YaRN x4, a multi-token-prediction layer
    "deepseek_v3": dict(BASE, **MOE, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                        norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                        v_head_dim=6, rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                                                    "beta_fast": 32, "beta_slow": 1}, num_nextn_predict_layers=1),
    # GLM-5's layout: DeepSeek-V3's (RoPE plain, not YaRN) with a lightning indexer of 16 heads of 8 dims choosing 5
    # keys per query, fewer than the tests' sequences hold (the attention is sparse there, dense on shorter ones)
    "glm_moe_dsa": dict(BASE, **MOE, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_group=2, topk_group=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, index_topk=5, index_head_dim=8,
                        index_n_heads=16, num_nextn_predict_layers=1),
    # Qwen3-Next's layout: gated delta-rule and gated full-attention layers in turn (each pipeline stage gets both),
    # value heads twice the key heads and wider (12 vs 8), RoPE on 4 of 16 dims, MoE with a gated shared expert, a
    # multi-token-prediction layer (under mtp.)
    "qwen3_next": dict(BASE, **dict(MOE, moe_intermediate_size=24), num_experts=4, shared_expert_intermediate_size=48,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], head_dim=16,
                       partial_rotary_factor=0.25, layer_types=["linear_attention", "full_attention"] * 2,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                       linear_value_head_dim=12, linear_conv_kernel_dim=4, mtp_num_hidden_layers=1),
    # Gemma 3's layout: a window on three of four layers (a pipeline stage holds both kinds) whose RoPE base is not
    # the global layers', linear RoPE scaling on those, a score scale that is not head_dim's, tied embeddings
    "gemma3_text": dict(BASE, head_dim=24, query_pre_attn_scalar=16, sliding_window=6, tie_word_embeddings=True,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                            "rope_theta": 1000000.0}}),
    # gpt-oss's layout: a window on every other layer, sinks, biases everywhere, YaRN x4 without truncation, 4 biased
    # experts (2 x 48 and 48 both differ from hidden 64: the stacked layouts cannot be confused) stored interleaved
    "gpt_oss": dict(BASE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
                    head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}),
    # Gemma 4's dense layout: a window on layers 0 and 2 (4 key/value heads); layers 1 and 3 full attention with wider
    # heads (32), 2 key/value heads and keys that are the values, proportional RoPE on a quarter of them; soft-capped
    # logits
    "gemma4_text": dict(BASE, num_key_value_heads=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
                        attention_k_eq_v=True,
                        sliding_window=6, hidden_size_per_layer_input=0, final_logit_softcapping=3.0,
                        tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"] * 2),
    # Gemma 4's 26B-A4B layout on the above: a dense MLP and 4 routed experts (top 2) side by side in every layer
    "gemma4_text_moe": dict(BASE, num_key_value_heads=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=2,
                            attention_k_eq_v=True, sliding_window=6, hidden_size_per_layer_input=0,
                            final_logit_softcapping=3.0, tie_word_embeddings=True,
                            layer_types=["sliding_attention", "full_attention"] * 2, enable_moe_block=True,
                            num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    # Gemma 4's E2B/E4B layout: per-layer inputs of 8 per layer; the last 3 of 6 layers (two windowed, one full)
    # attend with the keys and values of layers 1 (windowed) and 2 (full), their MLP twice as wide; no keys that are
    # the values, as in those models
    "gemma4_text_e2b": dict(BASE, num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=6,
                            hidden_size_per_layer_input=8, vocab_size_per_layer_input=200, num_kv_shared_layers=3,
                            use_double_wide_mlp=True, final_logit_softcapping=3.0, tie_word_embeddings=True,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    "mixtral": dict(BASE, intermediate_size=32, num_local_experts=3, num_experts_per_tok=2, router_aux_loss_coef=0.0,
                    sliding_window=None),
}
# Vision-language: Qwen2's decoder under multimodal RoPE, a 2-block vision tower with 4-pixel patches (an image of
# 16 x 16 pixels is a 4 x 4 patch grid, merged 2 x 2 into 4 tokens). Qwen2.5-VL's tower: windowed attention in
# block 0, full in block 1.
_VL_TEXT = dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 4]})
_VL_VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, initializer_range=0.05)
_VL_TOKENS = dict(image_token_id=196, video_token_id=197, vision_start_token_id=198, vision_end_token_id=199)
TINY_VL: dict[str, dict[str, Any]] = {
    "qwen2_vl": dict(text_config=_VL_TEXT, vision_config=_VL_VISION, **_VL_TOKENS),
    "qwen2_5_vl": dict(text_config=_VL_TEXT, vision_config=dict(_VL_VISION, intermediate_size=48, out_hidden_size=64,
                                                                window_size=16, fullatt_block_indexes=[1]),
                       **_VL_TOKENS),
}
# Qwen3-VL: Qwen3's decoder under interleaved mrope (sections T 4, H 2, W 2 of head_dim 16's 8 frequencies), a
# 3-block tower whose blocks 0 and 1 give deepstack features to decoder layers 0 and 1; its MoE sibling has 4 experts.
_VL3_TEXT = dict(BASE, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": [4, 2, 2], "mrope_interleaved": True})
_VL3_VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                   deepstack_visual_indexes=[0, 1], initializer_range=0.05)
TINY_VL |= {
    "qwen3_vl": dict(text_config=_VL3_TEXT, vision_config=_VL3_VISION, **_VL_TOKENS),
    # experts' 2 x moe_intermediate_size != hidden_size, so the two on-disk expert layouts cannot be confused
    "qwen3_vl_moe": dict(text_config=dict(_VL3_TEXT, **dict(MOE, moe_intermediate_size=24), num_experts=4,
                                          decoder_sparse_step=1),
                         vision_config=_VL3_VISION, **_VL_TOKENS),
}

# Qwen3.5: Qwen3-Next's hybrid decoder (gated delta rule and gated attention in turn, flat delta-rule projections),
# dense MLPs, interleaved mrope over the rotary quarter of each 32-wide head (4 frequencies: T 2, H 1, W 1),
# Qwen3-VL's tower without deepstack, a multi-token-prediction layer (under mtp.) as the hub's configs declare
_VL35_TEXT = dict(BASE, head_dim=32, layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                   "mrope_interleaved": True, "partial_rotary_factor": 0.25},
                  mtp_num_hidden_layers=1)
_VL35_VISION = {k: v for k, v in _VL3_VISION.items() if k != "deepstack_visual_indexes"}
TINY_VL["qwen3_5"] = dict(text_config=_VL35_TEXT, vision_config=_VL35_VISION, **_VL_TOKENS)
# Qwen3.5-MoE: no dense width; 4 experts of 24 (2 x 24 != hidden 64: the stacked layouts cannot be confused), shared 48
TINY_VL["qwen3_5_moe"] = dict(text_config=dict({k: v for k, v in _VL35_TEXT.items() if k != "intermediate_size"},
                                               num_experts=4, moe_intermediate_size=24, num_experts_per_tok=2,
                                               shared_expert_intermediate_size=48, router_aux_loss_coef=0.0),
                              vision_config=_VL35_VISION, **_VL_TOKENS)

# GLM-4.5V: GLM-4.5's tiny decoder (4 experts, the first layer dense, q/k/v biases, RoPE on half of each 16-wide head)
# without qk-norm or MTP, under mrope in blocks (T 2, H 1, W 1 of 4 frequencies); a 2-block tower of 4-pixel patches
# whose learned position table (4 x 4) is interpolated to each image's grid
_GLM_TEXT = {k: v for k, v in TINY["glm4_moe"].items() if k not in ("use_qk_norm", "num_nextn_predict_layers")}
TINY_VL["glm4v_moe"] = dict(
    text_config=dict(_GLM_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, image_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, initializer_range=0.05),
    image_token_id=196, video_token_id=197, image_start_token_id=192, image_end_token_id=193,
    video_start_token_id=198, video_end_token_id=199)

# Gemma 3 with images: Gemma 3's tiny decoder; a 2-block SigLIP encoder (no pooling head, as the hub's) of 16-pixel
# images cut into 4-pixel patches, which the projector pools 2 x 2 into 4 tokens per image (less than the window of
# 6: a window layer's image tokens see their whole image, as in the hub's models)
TINY_VL["gemma3"] = dict(
    text_config=TINY["gemma3_text"],
    vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       image_size=16, patch_size=4, vision_use_head=False),
    mm_tokens_per_image=4, image_token_index=196, boi_token_index=192, eoi_token_index=193)

# Gemma 4 as the hub stores it: Gemma 4's tiny decoder under model.language_model. (images' tokens seeing one another
# on the windowed layers, as the hub's configs say), a 2-layer vision tower of 4-pixel patches (pooled 2 x 2) and its
# embedder beside it, no audio tower
TINY_VL["gemma4"] = dict(
    text_config=dict(TINY["gemma4_text"], model_type="gemma4_text", use_bidirectional_attention="vision"),
    vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                       position_embedding_size=64),
    audio_config=None, image_token_id=196, video_token_id=197, audio_token_id=198, boi_token_id=192,
    eoi_token_id=193, boa_token_id=194, eoa_token_index=195, tie_word_embeddings=True)

# Gemma 4 26B-A4B as the hub stores it: the same, on the MoE block's decoder
TINY_VL["gemma4_moe"] = dict(TINY_VL["gemma4"], text_config=dict(TINY["gemma4_text_moe"], model_type="gemma4_text",
                                                                   use_bidirectional_attention="vision"))

# Gemma 4 E2B/E4B as the hub stores them: the small decoder beside the vision tower and an audio tower (a conformer
# block of 16, carried through training and export, never run)
TINY_VL["gemma4_e2b"] = dict(
    TINY_VL["gemma4"], text_config=dict(TINY["gemma4_text_e2b"], model_type="gemma4_text"),
    audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                      output_proj_dims=24))

# InternVL 3.5: Qwen3's tiny decoder (untied output layer, as the 2B-38B models); a 2-block InternViT of 16-pixel tiles
# cut into 4-pixel patches, whose 16 patches the projector folds 2 x 2 into 4 tokens per tile
TINY_VL["internvl"] = dict(
    text_config=dict(TINY["qwen3"], model_type="qwen3"),
    vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       image_size=[16, 16], patch_size=[4, 4]),
    image_seq_length=4, downsample_ratio=0.5, image_token_id=196, tie_word_embeddings=False)
# InternVL 3.5 GPT-OSS-20B-A4B: the same tower over gpt-oss's tiny decoder (sinks, windows, YaRN, biased experts)
TINY_VL["internvl_gpt_oss"] = dict(TINY_VL["internvl"], text_config=dict(TINY["gpt_oss"], model_type="gpt_oss"))


# TINY's names that are a variant of a family's layout, and the family
VARIANTS = {"llama3_tied": "llama", "gemma4_text_moe": "gemma4_text", "gemma4_moe": "gemma4",
            "gemma4_text_e2b": "gemma4_text", "gemma4_e2b": "gemma4", "internvl_gpt_oss": "internvl"}


def model_type_of(name: str) -> str:
    return VARIANTS.get(name, name)


def tiny_hf_config(name: str, **overrides: Any):
    return AutoConfig.for_model(model_type_of(name), **{**(TINY.get(name) or TINY_VL[name]), **overrides})


def save_tiny_model(name: str, directory: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides: Any) -> str:
    """Write a random tiny HF model of family ``name`` (see ``TINY``) to ``directory``."""
    # here: transformers' model classes load its generation modules; only writing a model needs them
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_hf_config(name, **overrides)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = auto.from_config(config, dtype=dtype)
    _randomize_correction_bias(model)
    _randomize_zero_biases(model)
    _randomize_zero_init(model)
    _shape_indexer(model)
    model.save_pretrained(directory)
    if _mtp_layers(config):
        add_mtp_layers(config, directory, dtype)
    return directory


def _mtp_layers(config: Any) -> int:
    """How many multi-token-prediction layers the config declares, under its family's key."""
    mtp = getattr(get_family(config), "mtp", None)
    return (getattr(config.get_text_config(), mtp.count, 0) or 0) if mtp else 0


def _randomize_zero_init(model: Any) -> None:
    """Models with zero-centred norms (hybrid ones, Gemma 3) start them at 0, and the delta rule's decay at fixed
    values; Gemma 4 its norms, router scales and layer scalars at 1: perturb them, so a test cannot pass by mistaking
    a norm's weight for its scale, or by leaving a scalar out."""
    transformer = get_family(model.config).config_from_hf(model.config).transformer
    if not (transformer.get("layernorm_zero_centered_gamma") or transformer.get("layer_scalars")):
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "router.scale", "per_expert_scale",
                              "dt_bias", "A_log")):
                param.add_(0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)


def _randomize_zero_biases(model: Any) -> None:
    """A family with biases on every linear (gpt-oss) starts most at 0: perturb them, as the norms above."""
    if not get_family(model.config).config_from_hf(model.config).transformer.get("add_bias_linear"):
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and not param.any():
                param.add_(0.1 * torch.randn_like(param))


@torch.no_grad()
def _shape_indexer(model: Any) -> None:
    """GLM-5's indexer: its key norm starts at weight 1, bias 0 (perturbed, as the norms above); its heads' weights
    made positive, so that a key scores 0 only where every head's ReLU is 0, which 16 heads make rare. Among keys
    of equal score transformers' topk picks by the length of the row it runs on (ours: the earlier key), so the tests
    hold our choice against transformers' where no two keys tie at the indexer's cut."""
    for name, module in model.named_modules():
        if name.endswith(".indexer"):
            module.k_norm.weight.add_(0.1 * torch.randn_like(module.k_norm.weight))
            module.k_norm.bias.add_(0.1 * torch.randn_like(module.k_norm.bias))
            module.weights_proj.weight.abs_()


def _randomize_correction_bias(model: Any) -> None:
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros as initialised: a mapping slip would go unseen
            buffer.copy_(torch.randn(buffer.shape) * 0.2)


@torch.no_grad()
def add_mtp_layers(config: Any, directory: str, dtype: torch.dtype, device: str = "cpu") -> None:
    """Multi-token-prediction layers as the family's checkpoints store them (``MultiTokenPrediction``), in a file of
    their own beside the model's (``model.safetensors.index.json`` lists both); transformers' save_pretrained drops
    them. Each is decoder layer ``num_hidden_layers + k`` of a model one layer deeper (a full-attention layer in a
    hybrid model), saved by transformers itself, plus ``enorm``, ``hnorm``, ``eh_proj`` and its final norm; DeepSeek's
    layout adds copies of the embedding and output layer, Qwen3-Next's moves it all under ``mtp.``."""
    # here: transformers' model classes load its generation modules; only writing a model needs them
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    index_path, single = os.path.join(directory, "model.safetensors.index.json"), "model.safetensors"
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    else:  # one file: it becomes a shard, so transformers and we both read through the index
        os.replace(os.path.join(directory, single), os.path.join(directory, "model-main.safetensors"))
        with safe_open(os.path.join(directory, "model-main.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {name: "model-main.safetensors" for name in f.keys()}}

    def read(name: str) -> torch.Tensor:
        with safe_open(os.path.join(directory, index["weight_map"][name]), "pt") as f:
            return f.get_tensor(name)

    family = get_family(config)
    mca = family.config_from_hf(config)
    text, count, extra = config.get_text_config(), mca.mtp_num_layers, len(family.mtp.copied_embeddings(mca))
    layers, hidden, hybrid = text.num_hidden_layers, text.hidden_size, bool(getattr(text, "layer_types", None))
    deeper_text = {**text.to_dict(), "num_hidden_layers": layers + count, family.mtp.count: 0}
    if hybrid:
        deeper_text["layer_types"] = list(text.layer_types) + ["full_attention"] * count
    for key in ("mlp_layer_types", "indexer_types"):  # GLM-5's lists per layer: an MTP layer is of the last's kind
        if isinstance(deeper_text.get(key), list):
            deeper_text[key] = deeper_text[key] + deeper_text[key][-1:] * count
    vision = hasattr(config, "vision_config")
    deeper = type(config)(**({**config.to_dict(), "text_config": deeper_text} if vision else deeper_text))
    with torch.device(device):
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(deeper, dtype=dtype)
    _randomize_correction_bias(model)
    _randomize_zero_init(model)
    prefix = family.hf_layers
    tensors: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch)
        del model
        for file in os.listdir(scratch):
            if file.endswith(".safetensors"):
                saved = load_file(os.path.join(scratch, file))
                tensors.update({n: t for n, t in saved.items()
                                if n.startswith(prefix) and int(n[len(prefix):].split(".")[0]) >= layers})
    centre = 0.0 if hybrid else 1.0  # hybrid models' norms scale by 1 + weight
    for k in range(count):
        layer = f"{prefix}{layers + k}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):  # not at their initial values: a swap would go unseen
            tensors[f"{layer}{norm}.weight"] = (centre + 0.1 * torch.randn(hidden)).to(dtype)
        tensors[f"{layer}eh_proj.weight"] = (torch.randn(hidden, 2 * hidden) * text.initializer_range).to(dtype)
        if extra:
            tensors[f"{layer}embed_tokens.weight"] = read("model.embed_tokens.weight")
            tensors[f"{layer}shared_head.head.weight"] = read("lm_head.weight")
    stored = family.weight_table(mca).stored
    tensors = {stored(name): tensor for name, tensor in tensors.items()}
    save_file(tensors, os.path.join(directory, "model-mtp.safetensors"), metadata={"format": "pt"})
    index["weight_map"].update({name: "model-mtp.safetensors" for name in tensors})
    with open(index_path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GLM_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")  # glm4_moe template
GEMMA_TOKENS = ("<start_of_turn>", "<end_of_turn>")  # LLaMA-Factory's gemma template (Gemma 3 1B)
GEMMA4_TOKENS = ("<|turn>", "<turn|>")  # its gemma4 template
MINIMAX_TOKENS = ("]~!b[", "]~b]", "[e~[")  # LLaMA-Factory's minimax2 template (its stop word becomes a special token)
GPT_OSS_TOKENS = ("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>")  # its gpt_oss template
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOPICS = ["cats", "rivers", "stars", "bread", "trains", "music", "rain", "chess", "ships", "gardens"]
SENTENCES = [
    "Tell me something about {topic} please .",
    "Here is a short fact : {topic} are often loved by many people around the world .",
    "Explain {topic} in one sentence .",
    "Sure , {topic} are interesting and simple to describe .",
    "Human : Assistant : system user assistant ### Instruction Response",
]


def corpus() -> list[str]:
    return [s.format(topic=t) for t in TOPICS for s in SENTENCES]


def save_tiny_tokenizer(directory: str, texts: list[str] | None = None, extra_special: tuple[str, ...] = ()) -> str:
    """A word-level tokenizer trained here on ``texts`` (no download) with Qwen-style ChatML tokens.

    Every word of ``texts`` is in the vocabulary, so a model with ``vocab_size >= len(tokenizer)`` sees no
    out-of-range ids. Works with LLaMA-Factory's qwen/qwen3_nothink/default templates; ``extra_special``: another
    template's special tokens (``GLM_TOKENS`` for glm4_moe).
    """
    # here: tokenizers' trainers and transformers' fast-tokenizer module; only writing a tokenizer needs them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.train_from_iterator(texts or corpus(),
                                  trainers.WordLevelTrainer(special_tokens=["<unk>", *SPECIAL_TOKENS, *extra_special]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", *extra_special],
                                   chat_template=CHAT_TEMPLATE)
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return directory


VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
GLM_VL_TOKENS = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
                 "<|video|>"]  # GLM-4.5V's (LLaMA-Factory's glm4v plugin writes them)
GEMMA_VL_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
# Gemma 4's, by the names its processor asks the tokenizer for (LLaMA-Factory's gemma4 plugin asks the processor)
GEMMA4_VL_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                    "video_token": "<|video|>"}
# InternVL's, by the names its processor asks the tokenizer for (LLaMA-Factory's intern_vl plugin writes the first
# three)
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}


def save_tiny_vl_model(name: str, directory: str, texts: list[str] | None = None, seed: int = 0,
                       dtype: torch.dtype = torch.float32, text_config: dict | None = None,
                       vision_config: dict | None = None, mm_tokens_per_image: int | None = None) -> str:
    """A vision-language model of family ``name`` (``TINY_VL``, or the shapes given) with its tokenizer and processor,
    as the hub ships them: the tokenizer knows the vision tokens, the config's token ids are the tokenizer's, and the
    image processor cuts the tower's patches (tiny: 4 pixels merged 2 x 2, so a 32 x 32 image is 16 tokens; Gemma 3:
    every image 16 pixels, pooled into ``mm_tokens_per_image`` tokens, 4). ``mm_tokens_per_image`` is also Gemma 4's
    budget per image (its processor's ``max_soft_tokens``, 70) and InternVL's tokens per tile (4): the real shapes'
    are 256 (Gemma 3, InternVL) and 280 (Gemma 4)."""
    # here: the processors load sentencepiece and torchvision's transforms; only VL models need them
    from transformers import (
        AutoTokenizer,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
        Glm4vProcessor,
        GotOcr2ImageProcessor,
        InternVLProcessor,
        Qwen2_5_VLProcessor,
        Qwen2VLProcessor,
        Qwen3VLProcessor,
    )
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.glm4v import Glm4vImageProcessor, Glm4vVideoProcessor
    from transformers.models.internvl import InternVLVideoProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl import Qwen3VLVideoProcessor

    save_tiny_tokenizer(directory, texts)
    glm, gemma = name == "glm4v_moe", name == "gemma3"
    gemma4, intern = model_type_of(name) == "gemma4", model_type_of(name) == "internvl"
    # Gemma 3's, Gemma 4's and InternVL's processors ask their tokenizer for the image tokens by name
    named_tokens = GEMMA_VL_TOKENS if gemma else GEMMA4_VL_TOKENS if gemma4 else INTERNVL_TOKENS if intern else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **({"extra_special_tokens": named_tokens} if named_tokens
                                                            else {}))
    vision_tokens = GLM_VL_TOKENS if glm else list(named_tokens.values()) if named_tokens else VL_TOKENS
    template_tokens = GLM_TOKENS if glm else GEMMA_TOKENS if gemma else GEMMA4_TOKENS if gemma4 else ["<|im_start|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": [*template_tokens, *vision_tokens]},
                                 replace_extra_special_tokens=not named_tokens)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in vision_tokens}
    text = dict(TINY_VL[name]["text_config"], **(text_config or {}))
    text["vocab_size"] = max(text["vocab_size"], len(tokenizer) + 3)
    vision = dict(TINY_VL[name]["vision_config"], **(vision_config or {}))
    extra = {}
    if gemma:  # every image resized to the encoder's size, pooled to mm_tokens_per_image tokens
        size = vision["image_size"]
        extra["mm_tokens_per_image"] = mm_tokens_per_image or TINY_VL[name]["mm_tokens_per_image"]
        processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": size, "width": size}),
                                    tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                                    image_seq_length=extra["mm_tokens_per_image"])
    elif gemma4:  # every image resized to at most 70 tokens (its fewest) of 2 x 2 patches of 4 pixels
        pixels = dict(patch_size=vision["patch_size"], pooling_kernel_size=vision["pooling_kernel_size"],
                      max_soft_tokens=mm_tokens_per_image or 70)
        processor = Gemma4Processor(feature_extractor=Gemma4AudioFeatureExtractor(),
                                    image_processor=Gemma4ImageProcessor(**pixels),
                                    video_processor=Gemma4VideoProcessor(**pixels), tokenizer=tokenizer,
                                    chat_template=CHAT_TEMPLATE)
    elif intern:  # every tile resized to the encoder's size (one tile per image: LLaMA-Factory's default)
        height, width = vision["image_size"]
        tile = {"height": height, "width": width}
        extra["image_seq_length"] = mm_tokens_per_image or TINY_VL[name]["image_seq_length"]
        processor = InternVLProcessor(image_processor=GotOcr2ImageProcessor(size=tile),
                                      video_processor=InternVLVideoProcessor(size=tile), tokenizer=tokenizer,
                                      chat_template=CHAT_TEMPLATE, image_seq_length=extra["image_seq_length"])
    else:
        patch, merge = vision["patch_size"], vision["spatial_merge_size"]
        pixels = dict(patch_size=patch, merge_size=merge, temporal_patch_size=vision["temporal_patch_size"],
                      min_pixels=(4 * patch) ** 2, max_pixels=(16 * patch * merge) ** 2)
        if glm:
            size = {"shortest_edge": pixels.pop("min_pixels"), "longest_edge": pixels.pop("max_pixels")}
            processor = Glm4vProcessor(image_processor=Glm4vImageProcessor(**pixels, size=size),
                                       video_processor=Glm4vVideoProcessor(**pixels, size=size), tokenizer=tokenizer,
                                       chat_template=CHAT_TEMPLATE)
        elif name.startswith("qwen3"):
            video_size = {"shortest_edge": pixels.pop("min_pixels"), "longest_edge": pixels.pop("max_pixels")}
            processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels, size=video_size),
                                         video_processor=Qwen3VLVideoProcessor(**pixels, size=video_size),
                                         tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
        else:
            processor = (Qwen2_5_VLProcessor if name == "qwen2_5_vl" else Qwen2VLProcessor)(
                image_processor=Qwen2VLImageProcessor(**pixels), video_processor=Qwen2VLVideoProcessor(**pixels),
                tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(directory)
    # the config's token ids: which of its keys names which vision token
    if glm:
        keys = dict(image_token_id="<|image|>", video_token_id="<|video|>", image_start_token_id="<|begin_of_image|>",
                    image_end_token_id="<|end_of_image|>", video_start_token_id="<|begin_of_video|>",
                    video_end_token_id="<|end_of_video|>")
    elif gemma:
        keys = {f"{kind}_index": token for kind, token in GEMMA_VL_TOKENS.items()}
    elif gemma4:
        keys = {f"{kind}_id": token for kind, token in GEMMA4_VL_TOKENS.items()}
    elif intern:
        keys = dict(image_token_id=INTERNVL_TOKENS["context_image_token"])
    else:
        keys = dict(image_token_id="<|image_pad|>", video_token_id="<|video_pad|>",
                    vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>")
    save_tiny_model(name, directory, seed=seed, dtype=dtype, text_config=text, vision_config=vision,
                    **{key: ids[token] for key, token in keys.items()}, **extra)
    return directory


def write_image_dataset(directory: str, n_rows: int, name: str = "tiny_images", video_every: int = 0,
                        ranking: bool = False, feedback: bool = False) -> str:
    """sharegpt rows with one or two small images each (LLaMA-Factory's mllm_demo format) and dataset_info.json;
    with ``video_every`` = k, every k-th row also holds a two-frame video (a list of frame files, which LLaMA-Factory
    reads like a decoded video); ``ranking=True``: a chosen and a rejected answer to each (the pairwise stages);
    ``feedback=True``: KTO's tag on each answer, two of every three desirable."""
    path = os.path.join(directory, "data")
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)

    def picture(file: str, height: int) -> str:
        Image.fromarray(rng.integers(0, 255, (height, 32, 3), dtype=np.uint8)).save(file)
        return file

    rows = []
    for i in range(n_rows):
        images = [picture(os.path.join(path, f"{name}_{i}_{k}.png"), (32, 48)[(i + k) % 2]) for k in range(1 + i % 2)]
        videos = [[picture(os.path.join(path, f"{name}_{i}_frame{k}.png"), 32) for k in range(2)]] \
            if video_every and i % video_every == 0 else []
        topic = TOPICS[i % len(TOPICS)]
        question = "<video>" * len(videos) + "<image>" * len(images) + SENTENCES[2].format(topic=topic)
        answer = {"role": "assistant", "content": SENTENCES[3].format(topic=topic)}
        if ranking:
            rejected = {"role": "assistant", "content": " ".join([SENTENCES[1].format(topic=topic)] * (1 + i % 2))}
            rows.append({"messages": [{"role": "user", "content": question}], "chosen": answer,
                         "rejected": rejected, "images": images, "videos": videos})
        else:
            rows.append({"messages": [{"role": "user", "content": question}, answer], "images": images,
                         "videos": videos} | ({"kto_tag": bool(i % 3)} if feedback else {}))
    with open(os.path.join(path, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    info = {"file_name": f"{name}.json", "formatting": "sharegpt",
            "columns": {"messages": "messages", "images": "images", "videos": "videos"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}
    if ranking:
        info["ranking"] = True
        info["columns"] |= {"chosen": "chosen", "rejected": "rejected"}
    if feedback:
        info["columns"]["kto_tag"] = "kto_tag"
    with open(os.path.join(path, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({name: info}, f, indent=1)
    return path


def alpaca_rows(n_rows: int, ranking: bool = False, feedback: bool = False) -> list[dict[str, Any]]:
    """Rows of varied length whose words all come from ``corpus()``; ``feedback``: KTO's tag on each, two of every
    three desirable (the off answer on the others)."""
    rows = []
    for i in range(n_rows):
        topic = TOPICS[i % len(TOPICS)]
        answer = " ".join([SENTENCES[1].format(topic=topic)] * (1 + i % 3))
        row: dict[str, Any] = {"instruction": SENTENCES[0].format(topic=topic), "input": ""}
        if ranking:
            row |= {"chosen": answer, "rejected": SENTENCES[3].format(topic=topic)}
        elif feedback:
            row |= {"output": answer if i % 3 else SENTENCES[3].format(topic=topic), "kto_tag": bool(i % 3)}
        else:
            row["output"] = answer
        rows.append(row)
    return rows


def write_alpaca_dataset(directory: str, n_rows: int, name: str = "tiny_alpaca", ranking: bool = False,
                         rows: list[dict[str, str]] | None = None, feedback: bool = False) -> str:
    """An alpaca-format JSON file plus LLaMA-Factory's ``dataset_info.json``; returns the dataset directory.

    ``ranking=True`` writes preference rows (``chosen``/``rejected``) for the pairwise (DPO) stage; ``feedback=True``
    rows tagged desirable or not (``kto_tag``) for KTO.
    """
    path = os.path.join(directory, "data")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(rows if rows is not None else alpaca_rows(n_rows, ranking, feedback), f, indent=1)
    info: dict[str, Any] = {"file_name": f"{name}.json"}
    if ranking:
        info |= {"ranking": True,
                 "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}}
    elif feedback:
        info["columns"] = {"prompt": "instruction", "query": "input", "response": "output", "kto_tag": "kto_tag"}
    with open(os.path.join(path, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({name: info}, f, indent=1)
    return path
