"""What one GPU of a run holds at its peak, from the plan alone: no weights read, no GPU touched.

The terms are Megatron's: bf16 weights, an fp32 gradient buffer, the distributed optimizer's fp32 main weights and
Adam moments sharded over the data-parallel ranks (experts over theirs), the activations a pipeline stage keeps for
its micro-batches in flight, and the last stage's logits. Activations are counted tensor by tensor for one layer
(what autograd saves in our native spec) and scaled by ``ACTIVATION_FIT``; it and ``LOGIT_BYTES`` were fitted to
the measured peaks (``torch.cuda.max_memory_allocated``) of the two-H200 runs in ``benchmarks/results``, and
``benchmarks/planner_check.py`` compares every measured run with its prediction. A vision tower (first stage) counts
its bf16 weights, and where it trains its gradients, optimizer states and activations, for ``image_share`` of the
tokens (frozen, its forward keeps nothing for the backward). CUDA-graphed layers
(``cuda_graphs``) keep less (``GRAPH_ACTIVATIONS``, measured on the dense benchmark) and hold a bf16 copy of the
experts' weight gradients that megatron-core's graph replay hands back (the MoE benchmark's extra). Not counted yet:
the gated delta-rule layers' own weights (they are counted as attention layers).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from ..models.config import attention_shape
from ..models.cost import attention_layer_kinds, attention_sizes, indexer_weights, small_gemma4_weights
from ..models.mapping import is_moe_layer
from ..models.native.fp8 import Fp8Training, casts_take_weights, grouped_pays
from ..models.native.logit_chunks import logit_rows
from ..parallel import ParallelLayout


GIB = 1024**3
ACTIVATION_FIT = 1.1  # measured / counted, per layer (norm and RoPE temporaries, the allocator's rounding)
LOGIT_BYTES = 6  # per logit at the loss: bf16 logits, their bf16 gradient, and fp32 pieces of the loss
ALLOCATOR = 1.05  # reserved / allocated at the peak
CONTEXT_GIB = 1.5  # the CUDA context and NCCL's buffers, beside the allocator
GRAPH_ACTIVATIONS = 0.4  # graphed / eager activations (the dense benchmark: 36.1-37.2 GiB measured against 41.8)
_REPLICATED = ParallelLayout(world_size=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=1, expert_dp=1,
                             micro_batch_size=1, grad_accum=1)  # the vision tower's blocks: whole on every rank
IMAGE_SHARE = 0.25  # where the data is not known: the share of a pack's tokens that are image placeholders


MOMENT_BYTES = {"fp32": 4, "bf16": 2}  # exp_avg_dtype / exp_avg_sq_dtype: bytes of one moment per parameter


def moment_bytes(exp_avg_dtype: str | None, exp_avg_sq_dtype: str | None) -> int:
    """Bytes of Adam's two moments per trained parameter (a key left out is fp32)."""
    return MOMENT_BYTES[exp_avg_dtype or "fp32"] + MOMENT_BYTES[exp_avg_sq_dtype or "fp32"]


@dataclasses.dataclass(frozen=True)
class Training:
    """What else of the recipe sizes the memory."""

    tokens: int  # per micro-batch row: the pack length (cutoff_len) or the padded row
    recompute: str | None = None  # recompute_granularity: None, "full" or "selective"
    recompute_modules: tuple[str, ...] = ("core_attn",)  # selective: what is rebuilt (Megatron's default)
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    cpu_offload: bool = False
    lora_rank: int | None = None  # LoRA on every linear of attention and dense MLP (lora_target: all)
    lora_experts: bool = False  # and on the experts (lora_target: all,experts)
    native_cross_entropy: bool = True
    chunked_cross_entropy: bool | None = None  # None: models/native/logit_chunks.py decides by size
    half: bool = True  # bf16 / fp16 weights with fp32 main weights; False: fp32 throughout (no main copy)
    param_remainders: bool = False  # store_param_remainders: the fp32 main weights as 16-bit remainders
    overlap_param_gather: bool = False  # the distributed optimizer's all-gather overlapped with the next forward
    moment_bytes: int = 8  # Adam's two moments per trained parameter: 8 in fp32, 4 with exp_avg(_sq)_dtype bf16
    cuda_graphs: bool = False
    freeze_vision_tower: bool = True  # LLaMA-Factory's defaults: the tower and its projector frozen
    freeze_projector: bool = True
    image_share: float = IMAGE_SHARE  # vision-language models: image placeholders per token
    fp8: Fp8Training | None = None  # FP8 linears on torch's scaled matmuls (models/native/fp8.py)


@dataclasses.dataclass(frozen=True)
class VisionTower:
    """The sizes of a VL model's vision tower that memory and speed depend on."""

    params: int
    trainable: int
    hidden: int
    ffn: int
    glu: int
    blocks: int
    patches_per_token: int  # patches behind one image placeholder token (the merger's spatial_merge_size squared)


_TOWERS: dict[str, VisionTower] = {}  # the search asks for the same tower once per candidate layout


def vision_tower(config: Any, training: Training) -> VisionTower | None:
    """The tower of a VL config, counted on the meta device (its own HF class, no weights), or None."""
    vision = config.hf_config.get("vision_config")
    if not vision:
        return None
    key = json.dumps([config.hf_config, training.freeze_vision_tower, training.freeze_projector], sort_keys=True,
                     default=str)
    if key not in _TOWERS:
        _TOWERS[key] = _count_tower(config, vision, training)
    return _TOWERS[key]


def _count_tower(config: Any, vision: dict[str, Any], training: Training) -> VisionTower:
    import torch  # the planner of a text model never needs torch

    from ..data.multimodal import tokens_per_image
    from ..models.families import get_family
    from ..models.freeze import vision_frozen
    from ..models.multimodal import build_vision_tower

    projector = get_family(config).vision.projector
    with torch.device("meta"):
        tower = build_vision_tower(config.hf_config, torch.bfloat16, projector)
    frozen = vision_frozen(config, training.freeze_vision_tower, training.freeze_projector)
    params = dict(tower.named_parameters())
    glu = 2 if any(".gate_proj." in name for name in params) else 1
    # the block's width and its MLP's as built (its first norm, its MLP's input projection): the configs name them
    # differently (Qwen2-VL's embed_dim and mlp_ratio, Qwen2.5/3-VL's hidden_size and intermediate_size; GLM-4.5V's
    # blocks take out_hidden_size, its intermediate_size is the merger's; SigLIP's blocks are encoder.layers,
    # InternViT's encoder.layer, whose first norm is layernorm_before)
    prefix = next(m.group(1) for name in params if (m := _FIRST_BLOCK.match(name)))
    block = {name[len(prefix):]: p for name, p in params.items() if name.startswith(prefix)}
    width = next(p.shape[0] for name, p in block.items()
                 if name.endswith(("norm1.weight", "norm_before.weight", "input_layernorm.weight")))
    ffn = next(p.shape[0] for name, p in block.items() if name.startswith("mlp.") and p.dim() == 2
               and p.shape[1] == width)
    # patches behind a placeholder: merged n x n, pooled k x k (Gemma 4), or (LLaVA's layout) a whole image pooled
    # to a fixed count
    if not projector:
        patches = vision.get("spatial_merge_size", 2) ** 2
    elif vision.get("pooling_kernel_size"):
        patches = vision["pooling_kernel_size"] ** 2
    else:
        patches = _side(vision["image_size"]) ** 2 // _side(vision["patch_size"]) ** 2 // tokens_per_image(
            config.hf_config)
    return VisionTower(params=sum(p.numel() for p in params.values()),
                       trainable=sum(p.numel() for n, p in params.items() if not frozen(n)),
                       hidden=width, ffn=ffn,
                       glu=glu, blocks=vision.get("depth") or vision.get("num_hidden_layers"),
                       patches_per_token=patches)


_FIRST_BLOCK = re.compile(r"^(.*?\b(?:blocks|layers|layer)\.0\.)")


def _side(size: int | list[int]) -> int:
    """A square image's or patch's side (InternVL's config gives [height, width])."""
    return size[0] if isinstance(size, (list, tuple)) else size


def _shapes(config: Any) -> dict[str, int]:
    t = config.transformer
    h = t["hidden_size"]
    # the share of the layers whose MLP is twice as wide (Gemma 4's E2B: those attending with earlier layers' keys)
    sharing = t.get("kv_sharing") or {}
    wide = (t["num_layers"] - sharing["first"]) / t["num_layers"] if sharing.get("double_wide_mlp") else 0
    # per layer, averaged over the windowed and the full-attention layers (Gemma 4's have heads of their own)
    kinds = attention_layer_kinds(t)
    attn_weights = sum(share * attention_sizes(kind)[0] for share, kind in kinds)
    q = sum(share * attention_sizes(kind)[1] for share, kind in kinds)
    kv = sum(share * attention_shape(kind).num_query_groups * attention_shape(kind).head_dim for share, kind in kinds)
    glu = 2 if t.get("gated_linear_unit", True) else 1
    return dict(h=h, q=q, kv=kv if not t.get("multi_latent_attention") else q,
                attn=attn_weights + indexer_weights(t), dsa=int(t.get("experimental_attention_variant") == "dsa"),
                f=t["ffn_hidden_size"], glu=glu, experts=t.get("num_moe_experts") or 0,
                topk=t.get("moe_router_topk") or 0,
                fm=t.get("moe_ffn_hidden_size") or 0, fs=t.get("moe_shared_expert_intermediate_size") or 0,
                vocab=config.vocab_size, layers=t["num_layers"], mtp=t.get("mtp_num_layers") or 0,
                block=int(bool(t.get("moe_block"))), ple=(t.get("per_layer_inputs") or {}).get("width", 0),
                softcap=int(bool(t.get("final_logit_softcapping"))),
                fa=t["ffn_hidden_size"] * (1 + wide))  # the MLP's width averaged over the layers, for activations


def _layer_params(s: dict[str, int], moe: bool) -> tuple[int, int]:
    """(parameters split by TP, expert parameters split by EP x ETP) of one decoder layer."""
    mlp = (s["glu"] + 1) * s["h"] * s["fs"] + s["experts"] * s["h"] if moe else (s["glu"] + 1) * s["h"] * s["f"]
    mlp += s.get("block", 0) * (4 * s["h"] + s["experts"])  # Gemma 4's MoE block: its norms and router scales
    experts = s["experts"] * (s["glu"] + 1) * s["h"] * s["fm"] if moe else 0
    return s["attn"] + 2 * s["h"] + mlp, experts


def _layer_activations(s: dict[str, int], tokens: float, layout: ParallelLayout, sequence_parallel: bool, moe: bool,
                       frozen_experts: bool, rebuilt: tuple[str, ...] = ()) -> float:
    """Bytes autograd keeps for one layer and one micro-batch of ``tokens`` (after the CP split); ``rebuilt``:
    selective recompute's modules, which keep only their inputs. LoRA's adapters on the dense MLP keep nothing of
    fc1's size beside it: the LoRA benchmark of the Qwen3-8B shape peaked at 50.1 GiB with the code of late November
    (one more copy of fc1's output, which this counted), at 40.8 GiB with December's (which change removed the copy
    was not established)."""
    tp, sp = layout.tp, layout.tp if sequence_parallel else 1
    hidden = 2 * tokens * s["h"] * 4 / sp  # the inputs of both norms, of QKV and of the MLP
    core = 0 if "core_attn" in rebuilt else s["q"]  # the attention kernel's output (also out-projection's input)
    attention = 2 * tokens * (s["q"] + 2 * s["kv"] + 2 * (s["q"] + s["kv"]) + s["q"] + core) / tp  # qkv, norm+rope
    # sparse attention keeps which keys each query attends (a byte per query and earlier key of its sequence: at
    # most a micro-batch of one sequence, whole on every TP rank)
    attention += s.get("dsa", 0) * tokens * tokens / 2
    if s.get("ple"):  # Gemma 4's per-layer input: its gate's output, the product (fc2's input), the norm's input
        hidden += 2 * tokens * (2 * s["ple"] / tp + s["h"] / sp)
    if not moe:
        mlp = 0 if "mlp" in rebuilt else 2 * tokens * (s["glu"] + 1) * s.get("fa", s["f"]) / tp
        return hidden + attention + mlp
    routed = tokens / sp * s["topk"]  # the tokens this rank's experts take, in expectation
    # permuted in (for fc1's weight gradient), the unpermute buffer, fc1 out and the activation's out (fc2's input);
    # frozen experts keep neither linear's input
    per_token = s["h"] + s["glu"] * s["fm"] / layout.etp if frozen_experts else \
        2 * s["h"] + (s["glu"] + 1) * s["fm"] / layout.etp
    experts = 0 if "moe" in rebuilt else 2 * routed * per_token
    shared = 2 * tokens * 2 * s["glu"] * s["fs"] / tp + 4 * tokens / sp * s["experts"]  # + fp32 router logits
    # Gemma 4's MoE block: the inputs of its branches' output norms and of the norm on their sum
    block = s.get("block", 0) * 2 * tokens * s["h"] * 3 / sp
    return hidden + attention + experts + shared + block


def _fp8_saved(s: dict[str, int], tokens: float, layout: ParallelLayout, sequence_parallel: bool, moe: bool,
               fp8: Fp8Training) -> float:
    """What FP8 changes in one covered, trained layer's kept activations (bytes, negative: less). Tensorwise keeps
    each linear's input for its weight gradient as one FP8 byte, transposed and gathered over the sequence-parallel
    ranks: QKV's and fc1's instead of their bf16 inputs, fc2's instead of the activation's bf16 output, and
    out-projection's beside the attention output its kernel keeps anyway. Rowwise keeps the bf16 inputs."""
    if fp8.rowwise or not fp8.wgrad:
        return 0.0
    tp, sp = layout.tp, layout.tp if sequence_parallel else 1
    change = 2 * tokens * s["h"] * (1 - 2 / sp) + tokens * s["q"] / tp
    if not moe:
        change -= tokens * s.get("fa", s["f"]) / tp
    return change


def _fp8_buffers(s: dict[str, int], tokens: float, layout: ParallelLayout, covered: list[bool], mine: list[bool],
                 cuda_graphs: bool, kept: list[float], in_flight: float, micro_batches: int, frozen: bool,
                 in_weights: bool) -> float:
    """FP8's copies at the peak: the step's weight casts (``fp8.WeightCasts``, held to the step's end; a graphed layer
    casts inside its graph and keeps none; a frozen base's, ``frozen``, are kept for the run in both layouts, graphed
    or not; trained dense weights', ``in_weights``, sit in the weights' own memory) and what the largest covered
    linear (fc1 or fc2) casts during its backward: its output's gradient in both layouts (its input's, for rowwise,
    after them).

    A weight's forward layout is cast at its first forward, its input gradient's at its first backward, while the
    layers' activations (``kept``, bytes per layer of one micro-batch) are being freed. A step of one micro-batch
    peaks at the end of its forward with the first alone, plus whatever the second outgrows the activations freed
    before it; where a second micro-batch's forward follows (``micro_batches`` > 1: the end of its forward is the
    peak, measured so under LoRA, ``h200_fp8/``) or micro-batches are in flight (``in_flight`` > 1: the backward
    has begun at the peak), both count."""
    f = s.get("fa", s["f"]) if s["f"] else s["fs"]
    out = max(s["glu"] * f, s["h"]) / layout.tp
    if cuda_graphs and not frozen:
        return 2 * tokens * out
    forward = backward = ahead = outgrown = 0.0
    for m, c, a in reversed(list(zip(mine, covered, kept))):  # the backward's order
        if c:
            dense = 0 if in_weights and not frozen else _layer_params(s, m)[0] / layout.tp
            forward += dense + (_expert_casts(s, tokens, layout, forward=True) if m else 0)
            made = dense + (_expert_casts(s, tokens, layout, forward=False) if m else 0)
            backward, ahead = backward + made, ahead + made
        outgrown = max(outgrown, ahead)
        ahead -= a  # this layer's activations go once its backward is done
    return forward + (backward if frozen or in_flight > 1 or micro_batches > 1 else outgrown) + 2 * tokens * out


def _expert_casts(s: dict[str, int], tokens: float, layout: ParallelLayout, forward: bool) -> float:
    """Bytes of a covered MoE layer's expert weight casts for its forward's GEMMs or its input gradient's: one FP8
    copy for each grouped GEMM (fc1's and fc2's) that runs in FP8 at the rows per expert of a micro-batch of
    ``tokens`` (``fp8.grouped_pays``; the others stay bf16 and cast nothing)."""
    rows = tokens * s["topk"] * layout.ep / s["experts"]
    h, fc2 = s["h"], s["fm"] / layout.etp
    fc1 = s["glu"] * fc2
    gemms = ((h, fc1), (fc2, h)) if forward else ((fc1, h), (h, fc2))  # (contracted, out)
    return s["experts"] / layout.ep * sum(k * n for k, n in gemms if grouped_pays(rows, k, n))


def estimate(config: Any, layout: ParallelLayout, training: Training) -> dict[str, float]:
    """GiB per GPU at the peak, the largest pipeline stage's (the first holds the most micro-batches in flight,
    the last the logits): each term, ``peak`` (predicted ``torch.cuda.max_memory_allocated``) and ``needs`` (with
    the allocator's headroom and the CUDA context: what the GPU must have)."""
    s = _shapes(config)
    t = config.transformer
    tower = vision_tower(config, training)
    layers = [is_moe_layer(s["experts"], t.get("moe_layer_freq", 1), i) for i in range(s["layers"])]
    per_stage = -(-s["layers"] // layout.pp)
    tokens = training.tokens * layout.micro_batch_size / layout.cp
    stages = []
    for stage in range(layout.pp):
        mine = layers[stage * per_stage:(stage + 1) * per_stage]
        last = stage == layout.pp - 1
        dense = sum(_layer_params(s, m)[0] for m in mine)
        experts = sum(_layer_params(s, m)[1] for m in mine)
        replicated = 0
        if stage == 0:
            dense += s["vocab"] * s["h"]
            # Gemma 4's E2B/E4B (they train on one stage): per-layer inputs, shared keys and values, wide MLPs
            replicated, split = small_gemma4_weights(t)
            dense += split
        if last and (not config.tie_word_embeddings or layout.pp > 1):
            dense += s["vocab"] * s["h"]
        if last and s["mtp"]:
            dense += s["mtp"] * (_layer_params(s, layers[-1])[0] + 2 * s["h"] * s["h"])
            experts += s["mtp"] * _layer_params(s, layers[-1])[1]
        params = dense / layout.tp + replicated + experts / (layout.ep * layout.etp)
        trainable, dp_share = params, (dense / layout.tp + replicated) / (layout.dp * layout.cp) + \
            (experts / (layout.ep * layout.etp)) / layout.expert_dp
        if training.lora_rank:  # frozen base: no gradient, no optimizer state; adapters on every linear
            r = training.lora_rank  # LLaMA-Factory's "all": attention and dense MLP projections, never experts
            attention = (s["h"] + s["q"]) * 2 + 2 * (s["h"] + s["kv"])
            mlp = (s["glu"] + 1) * (s["h"] + s["f"])
            experts_lora = (s["experts"] * r * (s["glu"] * (s["h"] + s["fm"]) + s["fm"] + s["h"])
                            if training.lora_experts else 0)
            trainable = dp_share = sum(r * (attention + (0 if m else mlp)) + (experts_lora if m else 0)
                                       for m in mine) / layout.tp
        tower_activations = 0.0
        if stage == 0 and tower is not None:
            params += tower.params  # replicated on the tensor-parallel ranks
            trainable += tower.trainable
            dp_share += tower.trainable / (layout.dp * layout.cp)
            patches = tokens * training.image_share * tower.patches_per_token
            if not training.freeze_vision_tower:  # every block keeps its activations
                blocks = dict(h=tower.hidden, q=tower.hidden, kv=tower.hidden, f=tower.ffn, glu=tower.glu)
                tower_activations = tower.blocks * ACTIVATION_FIT * _layer_activations(
                    blocks, patches, _REPLICATED, False, False, False)
            elif tower.trainable:  # the projector alone keeps its input
                tower_activations = 2 * patches * tower.hidden
        main = (2 if training.param_remainders else 4) if training.half else 0  # fp32 main weights, or their rest
        states = (training.moment_bytes + main) * (1 if training.distributed_optimizer else layout.dp * layout.cp)
        optimizer = 0.0 if training.cpu_offload else dp_share * states
        # activations: 1F1B keeps (pp - stage) micro-batches in flight (interleaving: a little more)
        in_flight = min(layout.pp - stage, layout.grad_accum)
        if (layout.vpp or 1) > 1 and layout.pp > 1:
            in_flight *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
        frozen = bool(training.lora_rank) and not training.lora_experts
        rebuilt = training.recompute_modules if training.recompute == "selective" else ()
        full = [_layer_activations(s, tokens, layout, training.sequence_parallel, m, frozen, rebuilt) * ACTIVATION_FIT
                for m in mine]
        fp8 = training.fp8
        covered = [fp8 is not None and fp8.covers(stage * per_stage + i + 1, s["layers"]) for i in range(len(mine))]
        if fp8 is not None and not training.lora_rank:  # the covered layers keep their inputs in FP8
            full = [a + _fp8_saved(s, tokens, layout, training.sequence_parallel, m, fp8) * ACTIVATION_FIT
                    if c else a for a, m, c in zip(full, mine, covered)]
        if training.recompute == "full":  # each layer keeps its input; one layer at a time is rebuilt in backward
            sp = layout.tp if training.sequence_parallel else 1
            kept = [2 * tokens * s["h"] / sp] * len(mine)
            activations = sum(kept) * in_flight + max(full, default=0)
        else:
            kept = full
            activations = sum(full) * in_flight
        if training.cuda_graphs:
            # graphed layers keep less; the replay's bf16 copies of the experts' weight gradients come on top. A
            # frozen base computes none, and its graphed layers kept what eager ones keep (LoRA MoE, one H200)
            if not training.lora_rank:
                activations = activations * GRAPH_ACTIVATIONS + 2 * experts / (layout.ep * layout.etp)
        activations += tower_activations * in_flight
        if fp8 is not None:
            in_weights = casts_take_weights(training.half, training.param_remainders, training.cpu_offload,
                                            training.overlap_param_gather, layout.dp * layout.cp, training.cuda_graphs)
            activations += _fp8_buffers(s, tokens, layout, covered, mine, training.cuda_graphs, kept, in_flight,
                                        layout.grad_accum, bool(training.lora_rank), in_weights)
        if stage == 0 and s["ple"]:  # the per-layer inputs, made whole on every rank: their norm's input and the sum
            activations += 2 * tokens * s["layers"] * s["ple"] * 2 * in_flight
        logits = 0.0
        if last:
            local_vocab = s["vocab"] / layout.tp
            rows = logit_rows(tokens, local_vocab, training.chunked_cross_entropy if training.native_cross_entropy
                              else False)
            # Megatron's loss: an fp32 copy; soft-capped logits (Gemma 4) under it keep tanh's bf16 output for its
            # backward too (the native loss caps them inside its passes)
            extra = 0 if training.native_cross_entropy else 4 + 2 * s["softcap"]
            logits = rows * local_vocab * (LOGIT_BYTES + extra) * (1 + s["mtp"])
        stages.append({"weights": params * (2 if training.half else 4) / GIB, "grads": trainable * 4 / GIB,
                       "optimizer": optimizer / GIB,
                       "activations": activations / GIB, "logits": logits / GIB})
    worst = max(stages, key=lambda b: sum(b.values()))
    peak = sum(worst.values())
    return {**{k: round(v, 2) for k, v in worst.items()}, "peak": round(peak, 2),
            "needs": round(peak * ALLOCATOR + CONTEXT_GIB, 2)}
