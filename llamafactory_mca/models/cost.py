"""The cost model: a model's FLOPs per step (Megatron's formula, causal attention counted as run) and its parameter
count, from its planned config. The planner prices layouts with it and the trainer reports MFU with it, so a run's
MFU and the plan's prediction are one formula."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .config import attention_shape, windowed_layer
from .mapping import is_moe_layer


# Dense bf16 peak (no sparsity) by device name; MFU is reported only where the peak is known.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362e12, "B200": 2250e12, "GB200": 2500e12}


def peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, value in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return value
    return None


def flops_per_sequence_set(t: dict[str, Any], vocab_size: int, seqlens: Sequence[int]) -> float:
    """Training FLOPs (forward + backward = 3 × forward) for sequences of these lengths.

    Megatron's accounting: every matmul counts 2·m·n·k; attention scores and values are s² per head
    dimension, halved for causal masking; MoE counts the top-k routed experts (active parameters),
    the shared expert and the router; the output layer counts the full vocabulary.
    """
    tokens = float(sum(seqlens))
    h = t["hidden_size"]
    per_layer = sum(share * (2 * tokens * attention_sizes(kind)[0] + _core_attention_forward(kind, squares))
                    for share, kind, squares in _attention_kinds(t, seqlens))  # the projections, the core
    linear_layers = sum(t.get("linear_attention_freq") or [])
    if linear_layers:  # hybrid models: the gated delta-rule layers replace that many attention layers
        per_layer = (per_layer * (_layer_count(t) - linear_layers) + _delta_rule_flops(t, tokens) * linear_layers
                     ) / _layer_count(t)
    glu = 3 if t.get("gated_linear_unit", True) else 2
    moe = dense = 0.0
    if t.get("num_moe_experts"):
        moe += _routed_expert_forward(t, tokens)
        moe += 2 * tokens * h * (t.get("moe_shared_expert_intermediate_size") or 0) * glu
        moe += 2 * tokens * h * t["num_moe_experts"]
    dense = 2 * tokens * h * t["ffn_hidden_size"] * glu
    moe_layers, layers, mtp = _moe_layer_count(t), _layer_count(t), t.get("mtp_num_layers") or 0
    forward = (per_layer * layers + moe * moe_layers + dense * (layers - moe_layers)
               + 2 * tokens * h * vocab_size * (1 + mtp) + mtp * 2 * tokens * 2 * h * h)  # MTP: logits and eh_proj
    return 3 * (forward + 2 * tokens * sum(small_gemma4_weights(t, matmuls=True)))


def small_gemma4_weights(t: dict[str, Any], matmuls: bool = False) -> tuple[int, int]:
    """What Gemma 4's E2B/E4B have beside the weights of every layer of their kind, over the whole model: (weights
    replicated on the tensor-parallel ranks, weights TP splits). The per-layer inputs (their embedding and norms
    replicated; the projection into them and each layer's gate and projection split), less the key and value
    projections and key norms of the layers attending with earlier layers' keys and values, plus the second half of
    their double-wide MLPs. ``matmuls``: the weights a token multiplies (the embedding's and the norms' left out).
    (0, 0) for other models."""
    h, layers = t["hidden_size"], t["num_layers"]
    replicated = split = 0
    spec, sharing = t.get("per_layer_inputs"), t.get("kv_sharing")
    if spec:
        d = spec["width"]
        split += h * layers * d + layers * 2 * h * d
        replicated += 0 if matmuls else spec["vocab"] * layers * d + d + layers * h
    if sharing:
        glu = 3 if t.get("gated_linear_unit", True) else 2
        for layer in range(sharing["first"], layers):
            kind = t if windowed_layer(t, layer) else full_attention_fields(t)
            _, groups, head_dim = attention_shape(kind)
            split -= h * groups * head_dim * (1 if kind.get("keys_are_values") else 2)
            replicated -= 0 if matmuls else head_dim
            split += glu * h * t["ffn_hidden_size"] if sharing.get("double_wide_mlp") else 0
    return replicated, split


def _core_attention_forward(t: dict[str, Any], squares: float) -> float:
    """One softmax-attention layer's QK^T and AV, forward, causal, for sequences whose squared lengths sum to
    ``squares``."""
    _, qk_width, v_width = attention_sizes(t)
    return 2 * squares * (qk_width + v_width) * 0.5


def core_attention_flops(t: dict[str, Any], seqlens: Sequence[int]) -> float:
    """QK^T and AV of every softmax-attention layer, forward only: what selective recompute of core attention adds."""
    layers = _layer_count(t) - sum(t.get("linear_attention_freq") or [])
    return sum(share * _core_attention_forward(kind, squares) for share, kind, squares in _attention_kinds(t, seqlens)
               ) * layers


def _attention_kinds(t: dict[str, Any], seqlens: Sequence[int]) -> list[tuple[float, dict[str, Any], float]]:
    """(share of the layers, their fields, the squared lengths the causal count halves) for the windowed and the
    full-attention layers: a sliding window of W tokens sees s·W - W²/2 pairs of a sequence of s > W tokens
    (2·s·W - W² in squares); Gemma 4's full-attention layers have heads of their own (``global_attention``)."""
    full = float(sum(s * s for s in seqlens))
    if not t.get("window_size"):
        return [(1.0, full_attention_fields(t), full)]
    w = t["window_size"][0] + 1
    windowed = float(sum(s * s if s <= w else 2 * s * w - w * w for s in seqlens))
    pattern = t.get("window_attn_skip_freq")
    share = (sum(pattern) / len(pattern) if isinstance(pattern, list)  # 1: a windowed layer
             else 1 - 1 / pattern if isinstance(pattern, int) else 1.0)  # every n-th layer full, or none
    return [(share, t, windowed), (1 - share, full_attention_fields(t), full)]


def attention_layer_kinds(t: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """(share of the layers, their fields) of the windowed and the full-attention layers."""
    return [(share, kind) for share, kind, _ in _attention_kinds(t, ())]


def full_attention_fields(t: dict[str, Any]) -> dict[str, Any]:
    """The full-attention layers' fields: Gemma 4's heads of their own (``global_attention``), else the model's."""
    full = t.get("global_attention")
    if not full:
        return t
    return {**t, "kv_channels": full["kv_channels"], "num_query_groups": full["num_query_groups"],
            "keys_are_values": full.get("keys_are_values", False)}


def _routed_expert_forward(t: dict[str, Any], tokens: float) -> float:
    """One MoE layer's routed experts, forward: the top-k experts' GEMMs."""
    glu = 3 if t.get("gated_linear_unit", True) else 2
    return 2 * tokens * t["hidden_size"] * t["moe_ffn_hidden_size"] * glu * t["moe_router_topk"]


def routed_expert_flops(t: dict[str, Any], tokens: float) -> float:
    """The routed experts' share of ``flops_per_sequence_set`` (training: 3 x forward, every MoE layer)."""
    return 3 * _routed_expert_forward(t, tokens) * _moe_layer_count(t) if t.get("num_moe_experts") else 0.0


def _delta_rule_sizes(t: dict[str, Any]) -> tuple[int, int, int, int]:
    """A gated delta-rule layer's (projection weights, other weights, key width, value width) over all heads."""
    h = t["hidden_size"]
    nv, keys = t["linear_num_value_heads"], t["linear_num_key_heads"] * t["linear_key_head_dim"]
    values = nv * t["linear_value_head_dim"]
    projections = h * (2 * keys + 2 * values + 2 * nv) + values * h  # in_proj, out_proj
    return projections, (2 * keys + values) * t["linear_conv_kernel_dim"] + 2 * nv + t["linear_value_head_dim"], \
        keys, values


def _delta_rule_flops(t: dict[str, Any], tokens: float, chunk: int = 64) -> float:
    """One gated delta-rule layer's forward: its projections, and per value head and token the chunked recurrence
    (the state [dk, dv] read by q and k and updated: ~3 products of dk x dv, plus causal attention inside each
    64-token chunk over dk and dv) — flash-linear-attention's work, approximately."""
    projections, _, _, _ = _delta_rule_sizes(t)
    dk, dv, nv = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_num_value_heads"]
    return 2 * tokens * projections + 2 * tokens * nv * (3 * dk * dv + chunk / 2 * (dk + dv))


def attention_sizes(t: dict[str, Any]) -> tuple[int, int, int]:
    """One layer's attention: (projection weights, query/key width, value width) over all heads; grouped-query or
    multi-latent (DeepSeek-V3: low-rank q and kv projections, a RoPE part shared by the keys, narrower values)."""
    h = t["hidden_size"]
    if t.get("multi_latent_attention"):
        n, rope, v = t["num_attention_heads"], t["qk_pos_emb_head_dim"], t["v_head_dim"]
        qk = t["qk_head_dim"] + rope
        q_rank, kv_rank = t.get("q_lora_rank"), t["kv_lora_rank"]
        q = h * n * qk if q_rank is None else h * q_rank + q_rank * n * qk
        kv = h * (kv_rank + rope) + kv_rank * n * (t["qk_head_dim"] + v)
        return q + kv + n * v * h, n * qk, n * v
    heads, groups, head_dim = attention_shape(t)
    q, kv = heads * head_dim, groups * head_dim
    gate = q * h if t.get("attention_output_gate") else 0  # q_proj's second half (Qwen3-Next)
    kv_projections = 1 if t.get("keys_are_values") else 2  # Gemma 4's full-attention layers: no v_proj
    return h * (q + kv_projections * kv) + q * h + gate, q, q


def indexer_weights(t: dict[str, Any]) -> int:
    """One layer's lightning indexer (DeepSeek sparse attention, GLM-5), 0 without one: the low-rank query to its
    heads, the input to its key and to its heads' weights, the key's LayerNorm. It runs without gradient, so the
    model's FLOPs leave it out."""
    if t.get("experimental_attention_variant") != "dsa":
        return 0
    h, heads, dim = t["hidden_size"], t["dsa_indexer_n_heads"], t["dsa_indexer_head_dim"]
    return (t.get("q_lora_rank") or h) * heads * dim + h * dim + 2 * dim + h * heads


def _layer_count(t: dict[str, Any]) -> int:
    """Decoder layers, and the transformer layers of multi-token prediction."""
    return t["num_layers"] + (t.get("mtp_num_layers") or 0)


def _moe_layer_count(t: dict[str, Any]) -> int:
    """How many of those are MoE layers (models like GLM-4.5 start with dense ones)."""
    return sum(is_moe_layer(t.get("num_moe_experts"), t.get("moe_layer_freq", 1), i) for i in range(_layer_count(t)))


def model_parameter_count(config: Any) -> int:
    """All parameters of the model (every expert), from its config."""
    t = config.transformer
    h = t["hidden_size"]
    heads, groups, head_dim = config.attention
    q, kv = heads * head_dim, groups * head_dim
    glu = 3 if t.get("gated_linear_unit", True) else 2
    layer = attention_sizes(t)[0] + indexer_weights(t) + 2 * h
    if t.get("add_qkv_bias"):
        layer += q + 2 * kv
    if t.get("qk_layernorm"):  # per head, or across all heads of a token (MiniMax-M2)
        layer += q + kv if t.get("qk_norm_across_heads") else 2 * head_dim
    if t.get("post_layer_norms"):
        layer += 2 * h
    if t.get("multi_latent_attention"):  # the latent norms
        layer += t["kv_lora_rank"] + (t.get("q_lora_rank") or 0)
    if t.get("softmax_type", "vanilla") == "learnable":  # a sink logit per head
        layer += heads
    biased = bool(t.get("add_bias_linear"))  # o_proj's, each MLP's and expert's two, the router's
    layer += h * biased
    moe = 0
    if t.get("num_moe_experts"):
        experts, width = t["num_moe_experts"], t["moe_ffn_hidden_size"]
        moe = experts * glu * h * width + experts * h
        moe += biased * experts * ((glu - 1) * width + h + 1)
        shared = t.get("moe_shared_expert_intermediate_size") or 0
        moe += glu * h * shared + (h if t.get("moe_shared_expert_gate") else 0)
        if t.get("moe_block"):  # Gemma 4's: three more norms, the router's input scale and per-expert scales
            moe += 4 * h + experts
    dense = glu * h * t["ffn_hidden_size"] + biased * ((glu - 1) * t["ffn_hidden_size"] + h)
    moe_layers, layers = _moe_layer_count(t), _layer_count(t)
    linear = 0  # the gated delta-rule layers have their own weights instead of the attention's
    if t.get("linear_attention_freq"):
        projections, other, _, _ = _delta_rule_sizes(t)
        full = attention_sizes(t)[0] + (2 * head_dim if t.get("qk_layernorm") else 0)
        linear = sum(t["linear_attention_freq"]) * (projections + other - full)
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    mtp = (t.get("mtp_num_layers") or 0) * (3 * h + 2 * h * h)  # enorm, hnorm, final norm, eh_proj
    full = 0  # Gemma 4's full-attention layers: their own heads (its layer scalars are buffers in transformers)
    if t.get("global_attention"):
        wide = full_attention_fields(t)
        extra = attention_sizes(wide)[0] - attention_sizes(t)[0] + 2 * (wide["kv_channels"] - head_dim)
        full = sum(not config.windowed(i) for i in range(t["num_layers"])) * extra
    return (layers * layer + moe_layers * moe + (layers - moe_layers) * dense + embeddings + h + mtp + linear + full
            + sum(small_gemma4_weights(t)))
