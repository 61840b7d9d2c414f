"""Which canonical tensors, and which piece of each, this rank's parameters hold — and filling them.

A local parameter name becomes a canonical name (global layer index from ``layer.layer_number``,
global expert index from the EP rank); its tensor-parallel piece is read off the parameter itself
(Megatron marks ``tensor_model_parallel`` and ``partition_dim`` on every split parameter), with the
expert-TP group for expert weights. This is the single place that knows local module layouts:
sequential experts, Megatron's legacy grouped experts (weight1/weight2) and TE's grouped experts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps

from ..errors import UserError
from .config import McaConfig
from .mapping import VISION_PREFIX, Dims, Shard, Source, WeightTable, canonical_mtp_name, canonical_norm_name


_TE_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.linear_fc([12])\.weight(\d+)$")
_SEQUENTIAL = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(.*)$")
_LEGACY_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.weight([12])$")
_GROUPED_BIAS = re.compile(r"^(.*\.mlp\.experts)\.bias([12])$")  # native grouped experts' [local_experts, out]


@dataclass
class Target:
    """One canonical tensor piece held by a local parameter (or a view of one)."""

    canonical: str
    shard: Shard | None
    view: Callable[[], torch.Tensor]  # the piece as [canonical layout], a view into the parameter where possible
    assign: Callable[[torch.Tensor], None]


def _tp_shard(param: torch.nn.Parameter, expert: bool) -> Shard | None:
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if expert:
        size, rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    else:
        size, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return Shard(param.partition_dim, rank, size) if size > 1 else None


def _copy_into(target: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def assign(value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(target.shape):
            raise UserError(f"shape mismatch: checkpoint gives {tuple(value.shape)}, model expects "
                             f"{tuple(target.shape)}")
        target.copy_(value.to(dtype=target.dtype, device=target.device))

    return assign


def global_layer_names(chunk: torch.nn.Module) -> dict[str, str]:
    """``decoder.layers.<local>.`` → ``decoder.layers.<global>.`` for this chunk."""
    mapping = {}
    decoder = getattr(chunk, "decoder", None)
    for local, layer in enumerate(getattr(decoder, "layers", [])):
        mapping[f"decoder.layers.{local}."] = f"decoder.layers.{layer.layer_number - 1}."
    return mapping


def local_targets(chunk: torch.nn.Module, num_experts: int | None = None) -> Iterator[Target]:
    layer_names = global_layer_names(chunk)
    num_layers = chunk.config.num_layers
    ep_rank = ps.get_expert_model_parallel_rank()
    ep_size = ps.get_expert_model_parallel_world_size()
    local_experts = (num_experts or 0) // max(ep_size, 1)
    first_expert = ep_rank * local_experts
    # the router's expert_bias (aux-loss-free balancing) is a buffer: it comes from the checkpoint too, as do the
    # towers' stored buffers (Gemma 4's clipped linears' bounds)
    towers = {n for n, _ in chunk.named_buffers() if n.startswith(VISION_PREFIX)}
    stored = towers & set(chunk.state_dict(keep_vars=True)) if towers else set()
    buffers = [(n, b) for n, b in chunk.named_buffers() if n.endswith(".router.expert_bias") or n in stored]
    for name, param in [*chunk.named_parameters(), *buffers]:
        for local, glob in layer_names.items():
            if name.startswith(local):
                name = glob + name[len(local):]
                break
        name = canonical_norm_name(canonical_mtp_name(name, num_layers))
        data = param.data
        if match := _LEGACY_GROUPED.match(name):
            prefix, which = match.group(1), match.group(2)
            hidden = data.shape[0] if which == "1" else data.shape[1]
            per_expert = data.view(local_experts, hidden, -1) if which == "1" else data.view(local_experts, -1, hidden)
            etp = ps.get_expert_tensor_parallel_world_size()
            shard = Shard(0 if which == "1" else 1, ps.get_expert_tensor_parallel_rank(), etp) if etp > 1 else None
            for k in range(local_experts):
                view = per_expert[k].t()  # canonical fc1 is [2f, hidden], fc2 [hidden, f]
                yield Target(f"{prefix}.local_experts.{first_expert + k}.linear_fc{which}.weight", shard,
                             (lambda v=view: v), _copy_into(view))
            continue
        if match := _GROUPED_BIAS.match(name):  # each expert whole on its rank (NativeGroupedMLP)
            for k in range(local_experts):
                view = data[k]
                yield Target(f"{match.group(1)}.local_experts.{first_expert + k}.linear_fc{match.group(2)}.bias", None,
                             (lambda v=view: v), _copy_into(view))
            continue
        if match := _TE_GROUPED.match(name):
            expert = first_expert + int(match.group(3))
            name = f"{match.group(1)}.local_experts.{expert}.linear_fc{match.group(2)}.weight"
        elif match := _SEQUENTIAL.match(name):
            name = f"{match.group(1)}.local_experts.{first_expert + int(match.group(2))}.{match.group(3)}"
        expert = ".mlp.experts." in name
        yield Target(name, _tp_shard(param, expert), (lambda d=data: d), _copy_into(data))


def dims_for(config: McaConfig, tensor_parallel_size: int) -> Dims:
    return Dims(**config.attention._asdict(), vocab_size=config.vocab_size,
                padded_vocab_size=config.padded_vocab_size(tensor_parallel_size),
                hidden_size=config.transformer["hidden_size"])


@torch.no_grad()
def load_hf_weights(chunks: list[torch.nn.Module], src: Source, table: WeightTable, dims: Dims,
                    num_experts: int | None = None) -> int:
    """Fill every parameter of ``chunks`` from ``src``; returns the number of parameters filled."""
    filled = 0
    for chunk in chunks:
        for target in local_targets(chunk, num_experts):
            op, names = table.lookup(target.canonical)
            try:
                target.assign(op.load(src, names, target.shard, dims))
            except (KeyError, ValueError) as err:
                raise UserError(f"loading {target.canonical} from {names}: {err}") from err
            filled += 1
    return filled
