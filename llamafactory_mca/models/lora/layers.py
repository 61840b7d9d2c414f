"""LoRA on Megatron's parallel linears: LLaMA-Factory's ``finetuning_type: lora``, adapters peft can load.

One adapter per Hugging Face module, as peft has them, so trainable parameters, initialisation and the saved
adapter are peft's: Megatron's fused ``linear_qkv`` carries separate q, k and v adapters, ``linear_fc1`` gate and up,
the gated delta-rule layer's ``in_proj`` Qwen3-Next's qkvz and ba (Qwen3.5's qkv, z, b and a). Their low-rank
outputs are laid out like the fused weight's rows with the weight table's own op (``FusedQKV`` interleaves per query
group, ``GroupedRows`` per key head), so the HF <-> Megatron layout is written once (``mapping.py``). The shared
expert's gate and Gemma 4's router projection, weights rather than linears in Megatron, take their adapters folded in
(``LoraFoldedMixin``).

Placement on tensor-parallel ranks (each adapter parameter holds exactly the HF tensor's rows it covers, so a dist
checkpoint's global adapter tensor *is* peft's tensor):

- column-parallel base (q/k/v, gate/up): A replicated [r, in], B split by rows like the base's output;
- row-parallel base (o, down): A split by columns like the base's input (the rank-r product is all-reduced), B
  replicated;
- sequence parallelism: the rank-r activation, not the hidden state, is gathered / reduce-scattered; a replicated
  factor then sees only its sequence shard and is marked ``sequence_parallel`` so Megatron all-reduces its gradient.

MoE experts (the word ``experts`` in ``lora_target``; never part of ``all``, as in LLaMA-Factory under transformers 5)
get one adapter per expert over the fused gate/up weight and one over down, peft's ``target_parameters`` on
``experts.gate_up_proj`` / ``experts.down_proj``; in the grouped GEMM they run as two more grouped GEMMs each.

The frozen base is frozen *before* Megatron's DDP wraps the model, so it gets no gradient buffer, no fp32 main copy
and no optimizer state; checkpoints hold only the adapters (``adapter_state``). Which modules get adapters, and how
each lies on a fused linear, is planned in ``targets.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from ...compat import has_transformer_engine
from ...errors import UserError
from ..families import get_family
from ..freeze import EXTRA_MODULES
from ..loading import dims_for, global_layer_names
from ..mapping import DictSource, Dims, GroupedRows, Op, Reshaped, WeightTable
from ..native.experts import NativeGroupedMLP, grouped_mm
from ..value_head import PREFIX as VALUE_HEAD_PREFIX
from .targets import (
    EXPERT_PIECES,
    EXPERTS_WORD,
    LoraSettings,
    Piece,
    TargetLinear,
    plan_targets,
    refuse_split_experts,
    refuse_split_pieces,
)


def _init_a(shape: tuple[int, ...], name: str, seed: int) -> torch.Tensor:
    """peft's default A init (kaiming-uniform, a=sqrt(5)) from a generator seeded by the tensor's global name, so
    every layout starts from the same adapter."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    fan_in = shape[-1]
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in)
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


def _set_tp_attributes(param: torch.nn.Parameter, dim: int | None, *, expert: bool, sequence_parallel: bool) -> None:
    if dim is not None:
        set_tensor_model_parallel_attributes(param, True, dim, 1)
    if expert:
        param.allreduce = False
    if sequence_parallel:
        param.sequence_parallel = True


class LoraLinearMixin:
    """Adapters beside a ColumnParallelLinear / RowParallelLinear (the class of a targeted module is swapped for a
    subclass with this mixin, so the base keeps its names, checkpoint keys and forward)."""

    lora_pieces: tuple[Piece, ...]
    lora_column: bool
    lora_assemble: Any
    lora_enabled: bool = True

    def init_lora(self, target: TargetLinear, global_name: str, settings: LoraSettings, dims: Dims) -> None:
        self.lora_column = isinstance(self, ColumnParallelLinear)
        self.lora_pieces, self.lora_scaling = target.pieces, settings.scaling
        self.lora_name, self.lora_target = global_name, target
        self.lora_dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else None
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        expert = ".experts." in global_name
        sp = bool(getattr(self, "sequence_parallel", False))
        weight = self.weight
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for piece in target.pieces:
            a_full = _init_a((settings.rank, piece.in_features), f"{global_name}.lora_A.{piece.name}", settings.seed)
            if self.lora_column:
                a, b = a_full, torch.zeros(piece.out_features // tp, settings.rank)
            else:
                step = piece.in_features // tp
                a, b = a_full[:, rank * step:(rank + 1) * step], torch.zeros(piece.out_features, settings.rank)
            A = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
            B = torch.nn.Parameter(b.to(weight.device, weight.dtype))
            _set_tp_attributes(A, None if self.lora_column else 1, expert=expert,
                               sequence_parallel=sp and self.lora_column)
            _set_tp_attributes(B, 0 if self.lora_column else None, expert=expert,
                               sequence_parallel=sp and not self.lora_column)
            self.lora_A[piece.name], self.lora_B[piece.name] = A, B
        names = [p.name for p in target.pieces]
        op = target.op
        if isinstance(op, Reshaped):  # a layer whose heads are not the model's
            dims, op = op.dims_of(dims), op.inner
        local = dims._replace(num_heads=dims.num_heads // tp, num_query_groups=dims.num_query_groups // tp)
        op = _local_op(op, tp)

        def assemble(b: dict[str, torch.Tensor]) -> torch.Tensor:
            """The pieces' B as one [rows of the fused linear, pieces x r] matrix, block-diagonal by piece."""
            if op is None or len(op.hf) == 1:
                return b[names[0]]
            r = settings.rank
            tensors, width = {}, r * len(names)
            rows = self.weight.shape[0] // len(op.hf) if type(op).__name__ == "GatedMLP" else None
            for hf_name in op.hf:
                short = hf_name[: -len(".weight")].rsplit(".", 1)[-1]
                if short in b:
                    k = names.index(short)
                    tensors[hf_name] = F.pad(b[short], (k * r, width - (k + 1) * r))
                else:
                    tensors[hf_name] = b[names[0]].new_zeros(rows or _piece_rows(op, hf_name, local), width)
            return op.load(DictSource(tensors), list(op.hf), None, local)

        self.lora_assemble = assemble

    def lora_rank_r(self, x: torch.Tensor) -> torch.Tensor:
        """x·Aᵀ, the rank-r activation, gathered or reduced over tensor-parallel ranks as B's input wants it."""
        group = self.tp_group
        if self.lora_dropout is not None:
            x = self.lora_dropout(x)
        a = torch.cat([self.lora_A[p.name] for p in self.lora_pieces]) if len(self.lora_pieces) > 1 else \
            self.lora_A[self.lora_pieces[0].name]
        h = F.linear(x, a)
        sp = bool(getattr(self, "sequence_parallel", False))
        if self.lora_column:
            h = mappings.gather_from_sequence_parallel_region(h, group=group) if sp else \
                mappings.copy_to_tensor_model_parallel_region(h, group=group)
        elif not getattr(self, "explicit_expert_comm", False):
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group) if sp else \
                mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        return h

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        output, bias = super().forward(input_, *args, **kwargs)
        if self.lora_enabled:
            output = self.lora_add(output, input_)
        return output, bias

    def lora_add(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """output + s·(x·Aᵀ)·Bᵀ, the scaling and the sum inside B's GEMM (cuBLAS's alpha and beta): written as
        peft computes it, the [tokens, out] delta would be scaled and added in two more passes over memory, and
        their backward a third (on a Qwen3-8B-shaped LoRA step, about a twentieth of its GPU time)."""
        h = self.lora_rank_r(x).to(output.dtype)
        b = self.lora_assemble(dict(self.lora_B)).to(output.dtype)
        out = torch.addmm(output.reshape(-1, output.shape[-1]), h.reshape(-1, h.shape[-1]), b.t(),
                          alpha=self.lora_scaling)
        return out.view(output.shape)

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold the adapters into the base weight (this rank's shard) and zero B."""
        a = torch.cat([self.lora_A[p.name] for p in self.lora_pieces]).float()
        b = self.lora_assemble({k: v.float() for k, v in self.lora_B.items()})
        self.weight.add_((b @ a * self.lora_scaling).to(self.weight.dtype))
        for b in self.lora_B.values():
            b.zero_()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        base = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        adapters = {f"lora_A.{k}": v for k, v in self.lora_A.items()} | \
            {f"lora_B.{k}": v for k, v in self.lora_B.items()}
        split = {k: (1 if k.startswith("lora_A") else None) if not self.lora_column else
                 (0 if k.startswith("lora_B") else None) for k in adapters}
        extra = make_sharded_tensors_for_checkpoint(
            adapters, prefix, {k: v for k, v in split.items() if v is not None}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        return base | extra


def _piece_rows(op: Op, hf_name: str, local: Dims) -> int:
    """Rows of one HF piece of a fused linear on this rank (FusedQKV: query groups x the piece's rows per group;
    GroupedRows: key heads x the piece's rows per head)."""
    index = op.hf.index(hf_name)
    if isinstance(op, GroupedRows):
        return op.groups * sum(rows for i, rows in op.parts if i == index)
    return local.num_query_groups * op.group_parts(local)[index][1]


def _local_op(op: Op | None, tp: int) -> Op | None:
    """The op laying out one tensor-parallel rank's rows: GroupedRows counts its groups (key heads) over all ranks."""
    return dataclasses.replace(op, groups=op.groups // tp) if isinstance(op, GroupedRows) else op


class LoraGroupedExpertsMixin:
    """Per-expert adapters inside NativeGroupedMLP's grouped GEMMs: fc1 (gate_up_proj) and fc2 (down_proj)."""

    lora_enabled: bool = True

    def init_lora(self, targets: list[TargetLinear], global_prefix: str, settings: LoraSettings,
                  first_expert: int) -> None:
        self.lora_scaling, self.lora_name, self.lora_first_expert = settings.scaling, global_prefix, first_expert
        self.lora_targets = targets
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        weight = self.weight1
        for target in targets:
            (piece,) = target.pieces
            linear = target.mca.rsplit(".", 1)[-1]
            a = torch.stack([_init_a((settings.rank, piece.in_features),
                                     f"{global_prefix}.{first_expert + e}.{linear}.lora_A.{piece.name}", settings.seed)
                             for e in range(self.num_local_experts)])
            b = torch.zeros(self.num_local_experts, piece.out_features, settings.rank)
            for key, value in (("A", a), ("B", b)):
                param = torch.nn.Parameter(value.to(weight.device, weight.dtype))
                _set_tp_attributes(param, None, expert=True, sequence_parallel=False)
                getattr(self, f"lora_{key}")[linear] = param

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        out, bias = super().forward(hidden, tokens_per_expert, probs)
        if hidden.nelement() == 0 and self.lora_enabled:  # no token here: still give the adapters (zero) gradients
            out = out + sum(p.sum() for p in (*self.lora_A.values(), *self.lora_B.values())) * 0
        return out, bias

    def _lora(self, linear: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        if not self.lora_enabled or linear not in self.lora_A:
            return None
        h = grouped_mm(x, self.lora_A[linear].transpose(1, 2).contiguous(), counts)
        # scaled at rank r, not on the [tokens, out] delta
        return grouped_mm(h * self.lora_scaling, self.lora_B[linear].transpose(1, 2).contiguous(), counts)

    def fc1(self, x: torch.Tensor, w1: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = super().fc1(x, w1, counts)
        delta = self._lora("linear_fc1", x, counts)
        return out if delta is None else out + delta.to(out.dtype)

    def fc2(self, x: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = super().fc2(x, w2, counts)
        delta = self._lora("linear_fc2", x, counts)
        return out if delta is None else out + delta.to(out.dtype)

    @torch.no_grad()
    def merge_lora(self) -> None:
        hidden = self.config.hidden_size
        w1 = self.weight1.view(self.num_local_experts, hidden, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, hidden)
        for linear, w in (("linear_fc1", w1), ("linear_fc2", w2)):
            if linear in self.lora_A:
                delta = torch.bmm(self.lora_B[linear].float(), self.lora_A[linear].float()) * self.lora_scaling
                w.add_(delta.transpose(1, 2).to(w.dtype))  # grouped weights are [in, out] per expert
                self.lora_B[linear].zero_()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        base = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        axis = len(sharded_offsets)
        for which in ("A", "B"):
            for linear, param in getattr(self, f"lora_{which}").items():
                key = f"{prefix}experts.{linear}.lora_{which}.{EXPERT_PIECES[linear]}"
                base[f"{prefix}lora_{which}.{linear}"] = ShardedTensor.from_rank_offsets(
                    key, param, *sharded_offsets, (axis, ep_rank, ep_size), replica_id=(0, 0, self.dp_group.rank()),
                    prepend_axis_num=axis)
        return base


class LoraFoldedMixin:
    """An adapter on a weight Megatron applies whole rather than through a parallel linear (``folded``: the
    parameter's name). Every read of it gives W + s·B·A, so its logits are peft's x·Wᵀ + s·(x·Aᵀ)·Bᵀ (without
    dropout: refused in ``plan_targets``). A and B are whole on every rank, marked ``sequence_parallel`` like the
    weight under SP (their gradients are then summed over TP)."""

    folded = ""
    lora_enabled: bool = True
    lora_replicated = True  # load_adapter: neither factor is split over tensor-parallel ranks

    def folded_weight(self) -> torch.Tensor:
        weight = self._parameters[self.folded]
        if not self.lora_enabled:
            return weight
        (piece,) = self.lora_pieces
        return weight + (self.lora_B[piece.name] @ self.lora_A[piece.name]).to(weight.dtype) * self.lora_scaling

    def init_lora(self, target: TargetLinear, global_name: str, settings: LoraSettings) -> None:
        self.lora_pieces, self.lora_scaling = target.pieces, settings.scaling
        self.lora_name, self.lora_target, self.lora_column = global_name, target, False
        weight = self._parameters[self.folded]
        (piece,) = target.pieces
        a = _init_a((settings.rank, piece.in_features), f"{global_name}.lora_A.{piece.name}", settings.seed)
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for store, value in ((self.lora_A, a), (self.lora_B, torch.zeros(piece.out_features, settings.rank))):
            store[piece.name] = torch.nn.Parameter(value.to(weight.device, weight.dtype))
            _set_tp_attributes(store[piece.name], None, expert=False, sequence_parallel=self.config.sequence_parallel)

    @torch.no_grad()
    def merge_lora(self) -> None:
        (piece,) = self.lora_pieces
        weight = self._parameters[self.folded]
        delta = self.lora_B[piece.name].float() @ self.lora_A[piece.name].float() * self.lora_scaling
        weight.add_(delta.to(weight.dtype))
        self.lora_B[piece.name].zero_()


class LoraSharedGateMixin(LoraFoldedMixin):
    """The shared expert's gate (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE: HF's ``shared_expert_gate``, a [1, hidden]
    linear; Megatron's SharedExpertMLP keeps its ``gate_weight`` and applies it with ``F.linear`` in both its forward
    paths)."""

    folded = "gate_weight"

    @property
    def gate_weight(self) -> torch.Tensor:
        return self.folded_weight()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        held = {name: self._modules.pop(name) for name in ("lora_A", "lora_B")}  # MLP's asks every child for its own
        try:
            base = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        finally:
            self._modules.update(held)
        adapters = {f"gate.lora_{w}.{k}": v for w in "AB" for k, v in getattr(self, f"lora_{w}").items()}
        return base | make_sharded_tensors_for_checkpoint(
            adapters, prefix, {}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"))


class LoraRouterMixin(LoraFoldedMixin):
    """A router's projection where HF's is a linear (Gemma 4's ``router.proj``, which LLaMA-Factory's ``all``
    selects): TopKRouter's ``weight``, read in its ``gating``. Its adapters are checkpointed beside it by
    MegatronModule's default (replicated, as the weight)."""

    folded = "weight"

    @property
    def weight(self) -> torch.Tensor:
        return self.folded_weight()


@functools.cache
def _lora_class(base: type, mixin: type) -> type:
    # a router's base classes (ABC first, then the module) leave it a layout a class with the mixin first cannot
    # take over; the router's mixin overrides nothing of the base, so it may follow it
    order = (base, mixin) if issubclass(mixin, LoraRouterMixin) else (mixin, base)
    return type(f"Lora{base.__name__}", order, {})


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(state: dict, additional: tuple[str, ...] = ()) -> dict:
    """The adapters' (and ``additional_target`` modules', and a reward model's value head's: trained whole)
    entries of a model's sharded state dict."""
    prefixes = tuple(EXTRA_MODULES[m] for m in additional) + (VALUE_HEAD_PREFIX,)
    return {k: v for k, v in state.items() if is_adapter_key(k) or k.startswith(prefixes)}


def _global_module_name(name: str, layer_names: dict[str, str], first_expert: int) -> str:
    for local, glob in layer_names.items():
        if name.startswith(local):
            name = glob + name[len(local):]
            break
    head, sep, tail = name.partition(".mlp.experts.local_experts.")
    if sep:  # sequential experts: local index -> global
        index, _, rest = tail.partition(".")
        name = f"{head}.mlp.experts.{first_expert + int(index)}" + (f".{rest}" if rest else "")
    return name


class LoraRun:
    """What ``apply_lora`` put on a model: the settings, the targets and the trainable-parameter count here."""

    def __init__(self, settings: LoraSettings, targets: list[TargetLinear], trainable: int) -> None:
        self.settings, self.targets, self.trainable = settings, targets, trainable

    def describe(self) -> str:
        names = sorted({p.name for t in self.targets if not t.experts for p in t.pieces})
        if any(t.experts for t in self.targets):
            names.append(EXPERTS_WORD)
        s = self.settings
        return (f"LoRA rank {s.rank}, alpha {s.alpha:g}{' (rsLoRA)' if s.rslora else ''}, dropout {s.dropout:g} on "
                f"{', '.join(names)}" + (f"; fully trained: {', '.join(s.additional)}" if s.additional else ""))


def apply_lora(model: Any, settings: LoraSettings, freeze_vision_tower: bool = True,
               planned: list[TargetLinear] | None = None) -> LoraRun:
    """Freeze the model and put adapters on the targeted linears of this rank's chunks (before DDP wraps it);
    ``planned``: the targets as the run's plan found and checked them (``peft_io.plan_lora``), else found here."""
    config = model.config
    table = get_family(config).weight_table(config)
    targets = planned
    if targets is None:
        targets = plan_targets(config.hf_config, table, settings, freeze_vision_tower)
        refuse_split_pieces(targets, ps.get_tensor_model_parallel_world_size())
        refuse_split_experts(settings, ps.get_expert_tensor_parallel_world_size())
    unknown = [m for m in settings.additional if m not in EXTRA_MODULES]
    if unknown:
        raise UserError(f"additional_target {unknown} is not supported with USE_MCA=1; choose from "
                        f"{sorted(EXTRA_MODULES)}.")
    dims = dims_for(config, 1)
    by_pattern = {t.mca: t for t in targets}
    expert_targets = [t for t in targets if t.experts]
    local_experts = (config.num_experts or 0) // ps.get_expert_model_parallel_world_size()
    first_expert = ps.get_expert_model_parallel_rank() * local_experts
    extra = tuple(EXTRA_MODULES[m] for m in settings.additional)
    for param in model.parameters():
        param.requires_grad_(False)
    placed = layers = 0
    for chunk in model.chunks:
        layers += len(getattr(getattr(chunk, "decoder", None), "layers", []))
        if getattr(chunk, "embedding", None) is not None:
            chunk.embedding.register_forward_hook(_activations_need_grad)
        layer_names = global_layer_names(chunk)
        for name, param in chunk.named_parameters():
            if extra and name.startswith(extra):
                param.requires_grad_(True)
        for name, module in list(chunk.named_modules()):
            glob = _global_module_name(name, layer_names, first_expert)
            pattern, _ = WeightTable.pattern_of(glob)
            if isinstance(module, NativeGroupedMLP):
                if expert_targets:
                    module.__class__ = _lora_class(type(module), LoraGroupedExpertsMixin)
                    module.init_lora(expert_targets, glob, settings, first_expert)
                    placed += 1
                continue
            if pattern.startswith("decoder.layers.*.mlp.experts.*."):  # a sequential expert's linear
                pattern = pattern.replace(".mlp.experts.*.", ".mlp.experts.")
            gate = by_pattern.get(pattern + ".gate") if isinstance(module, SharedExpertMLP) else None
            if gate is not None and module.use_shared_expert_gate:
                module.__class__ = _lora_class(type(module), LoraSharedGateMixin)
                module.init_lora(gate, f"{glob}.gate", settings)
                placed += 1
            if isinstance(module, TopKRouter) and pattern in by_pattern:
                module.__class__ = _lora_class(type(module), LoraRouterMixin)
                module.init_lora(by_pattern[pattern], glob, settings)
                placed += 1
            target = by_pattern.get(pattern)
            if target is not None and target.layers is not None:
                target = target.at(WeightTable.pattern_of(glob)[1][0])  # this layer's (Gemma 4's full-attention)
            if target is not None and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.__class__ = _lora_class(type(module), LoraLinearMixin)
                module.init_lora(target, glob, settings, dims)
                placed += 1
    if layers and not placed:
        raise UserError("LoRA found none of its target linears in this model's layers"
                        + (": Transformer Engine's fused linears do not take adapters yet; run LoRA in an environment "
                           "without transformer_engine (the native layer spec)." if has_transformer_engine() else "."))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model.lora = LoraRun(settings, targets, trainable)
    return model.lora


def _activations_need_grad(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """The frozen embedding's output made to require grad (transformers' ``enable_input_require_grads``): activation
    recomputation (Megatron's checkpoint, an autograd Function) passes gradients to the adapters inside a block only
    when the block's input requires grad."""
    return output.requires_grad_(True) if not output.requires_grad else output


def lora_modules(model: Any) -> list[torch.nn.Module]:
    return [m for chunk in model.chunks for m in chunk.modules()
            if isinstance(m, (LoraLinearMixin, LoraGroupedExpertsMixin, LoraFoldedMixin))]


def set_lora_enabled(model: Any, enabled: bool) -> None:
    """Adapters on or off (off: the frozen base, as peft's ``disable_adapter``: DPO's reference model)."""
    for module in lora_modules(model):
        module.lora_enabled = enabled


def merge_lora(model: Any) -> None:
    """Fold every adapter into its base weight and take the adapters off (LLaMA-Factory merges earlier adapters
    before it trains a new one)."""
    for module in lora_modules(model):
        module.merge_lora()
        module.__class__ = type(module).__bases__[1]
        del module.lora_A, module.lora_B
    model.lora = None
