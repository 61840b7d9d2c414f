"""Numbers for people: model FLOPs (Megatron's formula), MFU, memory estimates, the startup summary."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import torch

from ..models.config import attention_shape
from ..models.mapping import is_moe_layer
from ..parallel import ParallelLayout


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
    squares = _attention_squares(t, seqlens)
    h = t["hidden_size"]
    per_layer = 2 * tokens * attention_sizes(t)[0]  # the projections
    per_layer += _core_attention_forward(t, squares)
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
    return 3 * forward


def _core_attention_forward(t: dict[str, Any], squares: float) -> float:
    """One softmax-attention layer's QK^T and AV, forward, causal, for sequences whose squared lengths sum to
    ``squares``."""
    _, qk_width, v_width = attention_sizes(t)
    return 2 * squares * (qk_width + v_width) * 0.5


def core_attention_flops(t: dict[str, Any], seqlens: Sequence[int]) -> float:
    """QK^T and AV of every softmax-attention layer, forward only: what selective recompute of core attention adds."""
    layers = _layer_count(t) - sum(t.get("linear_attention_freq") or [])
    return _core_attention_forward(t, _attention_squares(t, seqlens)) * layers


def _attention_squares(t: dict[str, Any], seqlens: Sequence[int]) -> float:
    """The squared lengths the causal-attention count halves, averaged over the layers: a sliding window of W tokens
    sees s·W - W²/2 pairs of a sequence of s > W tokens (2·s·W - W² in squares) on the layers it covers."""
    full = float(sum(s * s for s in seqlens))
    if not t.get("window_size"):
        return full
    w = t["window_size"][0] + 1
    windowed = float(sum(s * s if s <= w else 2 * s * w - w * w for s in seqlens))
    pattern = t.get("window_attn_skip_freq")
    share = (sum(pattern) / len(pattern) if isinstance(pattern, list)  # 1: a windowed layer
             else 1 - 1 / pattern if isinstance(pattern, int) else 1.0)  # every n-th layer full, or none
    return share * windowed + (1 - share) * full


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
    return h * (q + 2 * kv) + q * h + gate, q, q


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
    layer = attention_sizes(t)[0] + 2 * h
    if t.get("add_qkv_bias"):
        layer += q + 2 * kv
    if t.get("qk_layernorm"):
        layer += 2 * head_dim
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
    dense = glu * h * t["ffn_hidden_size"] + biased * ((glu - 1) * t["ffn_hidden_size"] + h)
    moe_layers, layers = _moe_layer_count(t), _layer_count(t)
    linear = 0  # the gated delta-rule layers have their own weights instead of the attention's
    if t.get("linear_attention_freq"):
        projections, other, _, _ = _delta_rule_sizes(t)
        full = attention_sizes(t)[0] + (2 * head_dim if t.get("qk_layernorm") else 0)
        linear = sum(t["linear_attention_freq"]) * (projections + other - full)
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    mtp = (t.get("mtp_num_layers") or 0) * (3 * h + 2 * h * h)  # enorm, hnorm, final norm, eh_proj
    return layers * layer + moe_layers * moe + (layers - moe_layers) * dense + embeddings + h + mtp + linear


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def memory_estimate_gib(params_on_rank: int, args: Any, dp: int, trainable: int | None = None) -> dict[str, float]:
    """Weights + gradients + optimizer states per GPU (activations come on top and depend on the data). Frozen
    parameters (``trainable`` of them train) have neither gradients nor optimizer states."""
    trainable = params_on_rank if trainable is None else trainable
    weight_bytes = 2 if (args.bf16 or args.fp16) else 4
    grad_bytes = 4 if (args.accumulate_allreduce_grads_in_fp32 or weight_bytes == 4) else weight_bytes
    states = 12 if args.optimizer == "adam" else 8  # fp32 main params + moments (sgd: + momentum)
    if weight_bytes == 4:
        states -= 4  # fp32 training has no separate main copy
    elif getattr(args, "store_param_remainders", False):
        states -= 2  # the main copy's lower half only
    if args.use_distributed_optimizer:
        states /= dp
    gib = 1024**3
    result = {"weights": params_on_rank * weight_bytes / gib, "grads": trainable * grad_bytes / gib,
              "optimizer": trainable * states / gib}
    if args.optimizer_cpu_offload:
        result["optimizer"] = 0.0
    result["total"] = sum(result.values())
    return result


def gpu_memory_gib() -> tuple[float, float]:
    """(peak allocated, peak reserved) since the last reset, in GiB; zeros on CPU."""
    if not torch.cuda.is_available():
        return 0.0, 0.0
    return torch.cuda.max_memory_allocated() / 1024**3, torch.cuda.max_memory_reserved() / 1024**3


def startup_summary(*, layout: ParallelLayout, args: Any, packed: bool, model_type: str, params_total: int,
                    params_on_rank: int, kernels: str, tokens_per_step: int | None, steps: int, data_stats: str,
                    memory: dict[str, float], planned: dict[str, float] | None = None, tuning: str | None = None,
                    moe: str | None = None, startup: str | None = None) -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (gloo)"
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    lines = [
        "=" * 100,
        f"llamafactory_mca: training {model_type} ({params_total / 1e6:,.1f}M parameters) on {layout.world_size} x "
        f"{device}, {precision}",
        f"  layout      {layout.describe()}" + (", sequence parallel" if args.sequence_parallel else ""),
        f"  batch       global {layout.global_batch_size} = dp {layout.dp} x micro batch {layout.micro_batch_size}"
        f" x grad accumulation {layout.grad_accum}"
        + (f"; ~{tokens_per_step:,} tokens per step" if tokens_per_step else "")
        + (" (packed)" if packed else " (rows without padding)" if args.run_padding_free()
           else " (padded to the longest row)"),
        f"  steps       {steps}; lr {args.learning_rate:g} ({schedule}), warmup "
        f"{args.get_warmup_steps(steps)}, weight decay {args.weight_decay:g}, max grad norm {args.max_grad_norm:g}",
        f"  kernels     {kernels}",
        *([f"  MoE         {moe}"] if moe else []),
        *([f"  tuning      {tuning}"] if tuning else []),
        f"  optimizer   {args.optimizer}{' (distributed)' if args.use_distributed_optimizer else ''}"
        f"{', overlap grad reduce' if args.overlap_grad_reduce else ''}"
        f"{', overlap param gather' if args.overlap_param_gather else ''}"
        f"{', CPU offload' if args.optimizer_cpu_offload else ''}"
        f"{', fp32 masters as bf16 + 16-bit remainders' if getattr(args, 'store_param_remainders', False) else ''}",
        f"  recompute   {args.recompute_granularity or 'off'}"
        + (f" ({args.recompute_method}, {args.recompute_num_layers} layers)" if args.recompute_granularity == "full"
           else f" ({', '.join(args.recompute_modules or ['core_attn'])})" if args.recompute_granularity else ""),
        f"  parameters  {params_on_rank / 1e6:,.1f}M on this rank: weights {memory['weights']:.2f}, grads "
        f"{memory['grads']:.2f}, optimizer {memory['optimizer']:.2f} GiB",
        *([f"  memory      predicted peak per GPU {planned['peak']:.2f} GiB (largest stage: activations "
           f"{planned['activations']:.2f}, logits {planned['logits']:.2f}; {planned['needs']:.2f} GiB with the "
           "allocator's headroom; `llamafactory-mca plan` has the breakdown)"] if planned else []),
        f"  {data_stats}",
        *([f"  startup     {startup}"] if startup else []),
        "=" * 100,
    ]
    return "\n".join(lines)
