"""Which layouts of a recipe's global batch fit N GPUs, best first.

Every candidate goes through the layout check the run itself makes (``parallel.check_layout``), so the search never
proposes a layout the launcher would refuse; it walks TP, PP with VPP, CP, EP with ETP, the micro-batch and full
recompute. Speed: one GPU's step is the model's FLOPs at the efficiency each kind of work reaches on the GPU (the
dense GEMMs and attention, the routed experts, a vision tower's forward), plus the host's time to launch each layer's
kernels per micro-batch where the layers run eagerly (CUDA-graphed layers of dense models replay without it). The
constants were fitted to our one-GPU runs on H100 and H200 (``benchmarks/planner_check.py`` prints every measured run
beside its prediction); not modelled: the gated delta-rule layers' own cost (Qwen3-Next and Qwen3.5 are predicted
1.4-1.5x too fast) and LoRA adapters' launches (LoRA MoE with full recompute: 1.3x too fast). Each parallel dimension
then keeps the per-GPU share it kept at two GPUs against one (DP2, TP2 + SP, PP2 with 8 micro-batches, EP2, CP2:
``benchmarks/results/h200x2_two_gpus``); past two GPUs of a kind the share is extrapolated per doubling — an
ordering, not a promise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..args import LAYOUT_KEY
from ..errors import UserError
from ..models.cost import PEAK_BF16_FLOPS, core_attention_flops, flops_per_sequence_set, routed_expert_flops
from ..models.multimodal import check_vision_layout
from ..parallel import ParallelLayout, check_layout, cuda_graph_layout_needs
from .memory import Training, estimate, vision_tower


# the share of the GPU's peak each kind of work reaches, and the host's time per layer and micro-batch
EFFICIENCY = {"dense": 0.42, "experts": 0.22, "vision": 0.22}
# rows per expert and micro-batch from which the experts reach their efficiency: below it the experts' per-micro-batch
# costs (the fp32 weight-gradient pass, launches) weigh (refitted with the merged runs of h200_moe_merge/)
FULL_EXPERT_TOKENS = 512
HOST_SECONDS_PER_LAYER = 1.4e-3  # launching one layer's forward and backward kernels (eager, about 800 launches)
SHARE = {"dp": 0.92, "tp": 0.44, "cp": 0.92, "ep": 0.81}  # per-GPU tokens/s kept per doubling, measured at 2
PP_OVERHEAD = 0.78  # PP2's share beyond its bubble (send/receive, the last stage's logits)
TENSOR_PARALLEL = (1, 2, 4, 8)  # within a node's NVLink domain
DEFAULT_PEAK = PEAK_BF16_FLOPS["H100"]  # where no GPU is visible: speeds as on an H100


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: ParallelLayout
    recompute: str | None
    memory: dict[str, float]
    tokens_per_s: float  # predicted, per GPU
    graphs_off: bool = False  # the recipe asks for cuda_graphs, which this layout cannot run

    @property
    def keys(self) -> dict[str, Any]:
        """The recipe keys to paste."""
        out = {LAYOUT_KEY[size]: getattr(self.layout, size) for size in ("tp", "pp", "cp", "ep")}
        out.update(sequence_parallel=self.layout.tp > 1, per_device_train_batch_size=self.layout.micro_batch_size,
                   gradient_accumulation_steps=self.layout.grad_accum)
        if self.layout.vpp:
            out[LAYOUT_KEY["vpp"]] = self.layout.vpp
        if self.layout.etp > 1:
            out[LAYOUT_KEY["etp"]] = self.layout.etp
        if self.recompute:
            out["recompute_granularity"] = self.recompute
        if self.graphs_off:
            out["cuda_graphs"] = False
        return out


def _expert_efficiency(t: dict[str, Any], tokens: int) -> float:
    """The routed experts' efficiency: as measured at 512 or more tokens per expert and micro-batch (Qwen3-30B-A3B
    with two 4,096-token packs per micro-batch), falling with fewer (hundreds of experts: each GEMM too short to fill
    the GPU, and a weight-gradient pass per micro-batch whatever it holds). ``tokens``:
    those that reach one rank's experts (expert parallelism gathers its ranks' tokens)."""
    per_expert = tokens * (t.get("moe_router_topk") or 1) / (t.get("num_moe_experts") or 1)
    return EFFICIENCY["experts"] * min(1.0, per_expert / FULL_EXPERT_TOKENS)


def predicted_tokens_per_s(config: Any, layout: ParallelLayout, training: Training, peak_flops: float) -> float:
    """Tokens per second per GPU for packs of ``training.tokens`` (full packs)."""
    t, tokens = config.transformer, training.tokens
    forward = flops_per_sequence_set(t, config.vocab_size, [tokens]) / tokens / 3
    experts = routed_expert_flops(t, tokens) / tokens / 3
    rebuilt = 1 if training.recompute == "full" else 0  # one more forward
    # passes over the weights: forward, backward (a frozen base computes no weight gradients: one pass, not two), and
    # the recomputed forward; adapted experts count as trained ones (their adapters' many small GEMMs)
    frozen = training.lora_rank is not None
    dense_passes = 1 + (1 if frozen else 2) + rebuilt
    expert_passes = 1 + (1 if frozen and not training.lora_experts else 2) + rebuilt
    expert_efficiency = _expert_efficiency(t, tokens * layout.micro_batch_size * layout.ep)
    # selective recompute of core attention runs QK^T and AV forward once more, in the backward
    attention = (core_attention_flops(t, [tokens]) / tokens
                 if training.recompute == "selective" and "core_attn" in training.recompute_modules else 0.0)
    seconds = (((forward - experts) * dense_passes + attention) / EFFICIENCY["dense"]
               + experts * expert_passes / expert_efficiency) / peak_flops
    tower = vision_tower(config, training)
    if tower is not None:  # a frozen tower runs forward only
        passes = 1 if training.freeze_vision_tower else 3
        seconds += 2 * tower.params * training.image_share * tower.patches_per_token * passes / \
            (EFFICIENCY["vision"] * peak_flops)
    # graphs take the launches off the host; a fully trained MoE step waited on its GPU work even eagerly
    if not (training.cuda_graphs and (not t.get("num_moe_experts") or frozen)):
        seconds += HOST_SECONDS_PER_LAYER * t["num_layers"] * (1 + rebuilt) / (tokens * layout.micro_batch_size)
    share = 1.0
    # expert tensor parallelism splits the experts' GEMMs as TP splits the rest (not measured on its own)
    for name, size in (("dp", layout.dp), ("tp", layout.tp), ("cp", layout.cp), ("ep", layout.ep),
                       ("tp", layout.etp)):
        share *= SHARE[name] ** math.log2(size)
    if layout.pp > 1:  # the 1F1B bubble, (pp - 1) / (vpp x micro-batches) of the step
        share *= PP_OVERHEAD / (1 + (layout.pp - 1) / ((layout.vpp or 1) * layout.grad_accum))
    return share / seconds


def _layouts(config: Any, gpus: int, global_batch: int, tokens: int):
    """Every layout of ``gpus`` GPUs and this global batch: TP within a node, PP (and VPP over the layers), CP, EP,
    ETP (over the TP ranks), the micro-batch."""
    experts = config.transformer.get("num_moe_experts") or 0
    layers = config.transformer["num_layers"]
    for tp in (d for d in TENSOR_PARALLEL if gpus % d == 0):
        for pp in (d for d in range(1, gpus // tp + 1) if (gpus // tp) % d == 0):
            for vpp in [None] + [v for v in (2, 4) if pp > 1 and layers % (pp * v) == 0]:
                for cp in (d for d in (1, 2, 4, 8) if (gpus // (tp * pp)) % d == 0):
                    dp = gpus // (tp * pp * cp)
                    for ep in ([d for d in (1, 2, 4, 8, 16, 32, 64) if (tp * cp * dp) % d == 0 and d <= experts]
                               if experts else [1]):
                        for etp in [d for d in (1, 2, 4, 8) if d <= tp and (gpus // pp) % (ep * d) == 0] \
                                if experts else [1]:
                            for micro in (1, 2, 4):
                                if global_batch % (dp * micro) == 0:
                                    yield ParallelLayout(
                                        world_size=gpus, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp,
                                        expert_dp=gpus // (ep * etp * pp), micro_batch_size=micro,
                                        grad_accum=global_batch // (dp * micro), seq_length=tokens)


def search(config: Any, gpus: int, global_batch: int, training: Training, gpu_memory_gib: float,
           peak_flops: float) -> tuple[list[Candidate], dict[str, int]]:
    """(the layouts that fit, best first; why the others do not: a count per reason)."""
    fits, refused = [], {}
    moe = bool(config.transformer.get("num_moe_experts"))
    for layout in _layouts(config, gpus, global_batch, training.tokens):
        try:
            check_layout(config, layout, False, layout.tp > 1)
        except UserError as err:
            # "family: size=N does not divide ... (sizes that fit ...)": the size-free reason
            reason = str(err).split(": ", 1)[-1].split(" (sizes")[0]
            refused[reason] = refused.get(reason, 0) + 1
            continue
        try:
            check_vision_layout(config, layout)
        except UserError:
            reason = "a vision-language model: no context parallelism, deepstack layers on the tower's stage"
            refused[reason] = refused.get(reason, 0) + 1
            continue
        for recompute in (None, "full") if config.recomputes_whole_layers else (None,):
            # graphs where the recipe asks and the layout allows them
            graphs = training.cuda_graphs and all(holds for _, holds, _ in cuda_graph_layout_needs(layout, recompute,
                                                                                                   moe))
            shaped = dataclasses.replace(training, recompute=recompute, sequence_parallel=layout.tp > 1,
                                         cuda_graphs=graphs)
            memory = estimate(config, layout, shaped)
            if memory["needs"] > gpu_memory_gib:
                key = f"needs more than {gpu_memory_gib:g} GiB per GPU"
                refused[key] = refused.get(key, 0) + 1
                continue
            speed = predicted_tokens_per_s(config, layout, shaped, peak_flops)
            fits.append(Candidate(layout, recompute, memory, speed, graphs_off=training.cuda_graphs and not graphs))
    # ties (the same predicted speed): the simpler layout, then the smaller footprint
    fits.sort(key=lambda c: (-round(c.tokens_per_s), c.layout.tp * c.layout.pp * (c.layout.vpp or 1) * c.layout.cp
                             * c.layout.ep * c.layout.etp, c.memory["needs"]))
    return fits, refused
