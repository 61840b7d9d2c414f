"""The closed set of weight-mapping ops; each implements both directions so they cannot drift apart.

Names are full state-dict names with ``*`` for the layer index (and a second ``*`` for the expert
index). The Megatron side is the single-rank ("canonical") name — what a world-size-1 model with
per-expert (sequential) experts calls the tensor, with global layer and expert indices. How a tensor
is split over tensor-parallel ranks is not the op's business to decide: the loader passes a
``Shard`` read off the Megatron parameter itself; the op only knows how its HF tensors line up with
that split (a fused QKV splits by query group, a fused gate/up splits each half).

Some HF checkpoints stack a layer's experts into one tensor (Qwen3-VL-MoE's ``experts.gate_up_proj`` [E, in, out]).
Their HF name ends in ``#*``: the expert index goes after the ``#`` like any other index, the op reads that expert's
slice, and the exporter stacks the experts back into one tensor (``split_expert``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import torch


def is_moe_layer(num_experts: int | None, moe_layer_freq: int | list[int], layer: int) -> bool:
    """Whether global decoder layer ``layer`` (from 0) is an MoE layer, by Megatron's ``moe_layer_freq``: an int N
    makes every N-th layer from layer 0 sparse, a list marks each layer 1 (MoE) or 0 (dense). A multi-token-
    prediction layer (``layer`` past the list) is of the last decoder layer's kind, as its spec is
    (``spec.get_mtp_block_spec``)."""
    if not num_experts:
        return False
    if isinstance(moe_layer_freq, list):
        return bool(moe_layer_freq[min(layer, len(moe_layer_freq) - 1)])
    return layer % moe_layer_freq == 0


def is_linear_attention_layer(linear_attention_freq: list[int] | None, layer: int) -> bool:
    """Whether global decoder layer ``layer`` is a gated delta-rule layer (hybrid models mark each layer 1 / 0 in
    ``linear_attention_freq``); any other model's layers, and a multi-token-prediction layer, are full attention."""
    return bool(linear_attention_freq) and layer < len(linear_attention_freq) and bool(linear_attention_freq[layer])


class Shard(NamedTuple):
    """This rank's part of a canonical tensor: ``size`` equal pieces along ``dim``, piece ``rank``."""

    dim: int
    rank: int
    size: int

    def bounds(self, length: int) -> tuple[int, int]:
        step = length // self.size
        return self.rank * step, (self.rank + 1) * step


class Source(Protocol):
    """Where HF tensors come from: safetensors files (slice reads) or a dict in memory."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor, or its [start:stop) slice along ``dim``."""
        ...


class DictSource:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name, dim=None, start=0, stop=None):
        tensor = self.tensors[name]
        if dim is None:
            return tensor
        return tensor.narrow(dim, start, (stop if stop is not None else tensor.shape[dim]) - start)


VISION_PREFIX = "vision."  # our name of a vision-language model's tower inside a model chunk (models/multimodal.py)
EXPERT_SLICE = "#"


def split_expert(name: str) -> tuple[str, int | None]:
    """``"….gate_up_proj#5"`` → (``"….gate_up_proj"``, 5); a plain name → (name, None)."""
    base, sep, index = name.rpartition(EXPERT_SLICE)
    return (base, int(index)) if sep else (name, None)


def fill(pattern: str, indices: tuple[int, ...]) -> str:
    """``fill("a.*.b.*.c", (3, 5)) == "a.3.b.5.c"``."""
    parts = pattern.split("*")
    if len(parts) - 1 != len(indices):
        raise ValueError(f"{pattern!r} takes {len(parts) - 1} indices, got {indices}")
    out = parts[0]
    for index, part in zip(indices, parts[1:]):
        out += str(index) + part
    return out


@dataclass(frozen=True)
class Op:
    mca: str
    hf: tuple[str, ...]
    export: bool = True  # False: loaded from HF, never written back (a tied output layer)

    def load(self, src: Source, names: list[str], shard: Shard | None, dims: Dims) -> torch.Tensor:
        """This rank's piece (``shard``) or all (None) of the Megatron tensor, reading only what it needs."""
        raise NotImplementedError

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        """The full Megatron tensor back to its HF tensors, in the order of ``self.hf``."""
        raise NotImplementedError

    def rows_as_ours(self, rows: torch.Tensor) -> torch.Tensor:
        """A tensor of this weight's output rows (a LoRA B) from HF's row order to the one Megatron holds."""
        return rows

    def rows_as_hf(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def moved(self, move: Callable[[str], str]) -> Op:
        """This op with its HF names moved (a VL checkpoint keeps the language model under a prefix)."""
        return replace(self, hf=tuple(move(name) for name in self.hf))


class Dims(NamedTuple):
    """The few sizes the fused ops need."""

    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    hidden_size: int


def _part(src: Source, name: str, shard: Shard | None) -> torch.Tensor:
    if shard is None:
        return src.get(name)
    return src.get(name, shard.dim, *shard.bounds(src.shape(name)[shard.dim]))


@dataclass(frozen=True)
class Rename(Op):
    """One HF tensor is the Megatron tensor (further HF names: copies of it, written on export and never read).
    ``vocab``: rows padded up to the padded vocabulary."""

    vocab: bool = False

    def load(self, src, names, shard, dims):
        name = names[0]  # the others are copies of it (``embeddings``: multi-token prediction's)
        if not self.vocab:
            return _part(src, name, shard)
        lo, hi = (0, dims.padded_vocab_size) if shard is None else shard.bounds(dims.padded_vocab_size)
        if shard is not None and shard.dim != 0:
            raise ValueError(f"{self.mca}: the vocabulary is split along dim 0, not {shard.dim}")
        real = src.get(name, 0, lo, min(hi, dims.vocab_size)) if lo < dims.vocab_size else None
        rows = 0 if real is None else real.shape[0]
        if rows == hi - lo:
            return real
        width = src.shape(name)[1:]
        pad = torch.zeros((hi - lo - rows, *width), dtype=(real.dtype if real is not None else torch.float32))
        return pad if real is None else torch.cat([real, pad])

    def to_hf(self, tensor, dims):
        tensor = tensor[: dims.vocab_size] if self.vocab else tensor
        return [tensor] + [tensor.clone() for _ in self.hf[1:]]  # safetensors refuses tensors sharing memory


def _load_grouped(src: Source, names: list[str], parts: tuple[tuple[int, int], ...], groups: int,
                  shard: Shard | None, what: str) -> torch.Tensor:
    """Rows interleaved per group from HF tensors that each store their parts one after another: ``parts`` lists
    (which HF tensor, rows per group) in the Megatron group's order. TP splits whole groups, so a rank reads one
    contiguous block of every part."""
    first, count = 0, groups
    if shard is not None:
        if shard.dim != 0:
            raise ValueError(f"{what}: the grouped rows are split along dim 0, not {shard.dim}")
        count = groups // shard.size
        first = shard.rank * count
    offsets, pieces = {}, []
    for index, rows in parts:
        start = offsets.get(index, 0)
        piece = src.get(names[index], 0, start + first * rows, start + (first + count) * rows)
        pieces.append(piece.reshape(count, rows, *piece.shape[1:]))
        offsets[index] = start + groups * rows
    return torch.cat(pieces, dim=1).reshape(-1, *pieces[0].shape[2:])


def _grouped_to_hf(tensor: torch.Tensor, parts: tuple[tuple[int, int], ...], groups: int) -> list[torch.Tensor]:
    """The inverse of ``_load_grouped`` for the whole tensor: each HF tensor, its parts in order."""
    tail = tensor.shape[1:]
    pieces = torch.split(tensor.reshape(groups, -1, *tail), [rows for _, rows in parts], dim=1)
    out: dict[int, list[torch.Tensor]] = {}
    for (index, _), piece in zip(parts, pieces):
        out.setdefault(index, []).append(piece.reshape(-1, *tail))
    return [torch.cat(out[i]).contiguous() for i in sorted(out)]


@dataclass(frozen=True)
class GroupedRows(Op):
    """Megatron rows interleaved per group ([part 0 | part 1 | ...] for each group) from HF tensors holding each part
    for all groups in turn. ``parts``: (index into ``hf``, rows per group) in the group's order; ``groups``: how many.
    The gated delta-rule layers group per key head (``native/gated_delta.py``): Qwen3.5's flat ``in_proj_qkv``
    is three parts (q, k, v of every head), its conv1d too; a tensor already grouped per head (Qwen3-Next's
    ``in_proj_qkvz``) is one part of its whole group."""

    parts: tuple[tuple[int, int], ...] = ()
    groups: int = 1

    def load(self, src, names, shard, dims):
        return _load_grouped(src, names, self.parts, self.groups, shard, self.mca)

    def to_hf(self, tensor, dims):
        return _grouped_to_hf(tensor, self.parts, self.groups)


@dataclass(frozen=True)
class FusedQKV(Op):
    """q, k, v → Megatron's linear_qkv, interleaved per query group: [g0: q.. k v][g1: q.. k v]...

    Tensor parallelism splits whole query groups, so a rank reads one contiguous block of q, k and v.
    Works for weights [rows, hidden] and biases [rows].
    """

    def group_parts(self, dims: Dims) -> tuple[tuple[int, int], ...]:
        per_group = dims.num_heads // dims.num_query_groups * dims.head_dim
        return (0, per_group), (1, dims.head_dim), (2, dims.head_dim)

    def load(self, src, names, shard, dims):
        return _load_grouped(src, names, self.group_parts(dims), dims.num_query_groups, shard, self.mca)

    def to_hf(self, tensor, dims):
        return _grouped_to_hf(tensor, self.group_parts(dims), dims.num_query_groups)


@dataclass(frozen=True)
class FusedQK(FusedQKV):
    """Attention whose keys are also its values (Gemma 4's ``attention_k_eq_v``): no v_proj; Megatron's linear_qkv
    holds per query group [its heads' q | k]."""

    def group_parts(self, dims: Dims) -> tuple[tuple[int, int], ...]:
        return (0, dims.num_heads // dims.num_query_groups * dims.head_dim), (1, dims.head_dim)


@dataclass(frozen=True)
class Reshaped(Op):
    """``inner`` with attention sizes of its own: a layer whose heads are not the model's (``PerLayer``)."""

    inner: Op | None = None
    shape: tuple[int, int, int] = (0, 0, 0)  # heads, query groups, head_dim

    def dims_of(self, dims: Dims) -> Dims:
        heads, groups, head_dim = self.shape
        return dims._replace(num_heads=heads, num_query_groups=groups, head_dim=head_dim)

    def load(self, src, names, shard, dims):
        return self.inner.load(src, names, shard, self.dims_of(dims))

    def to_hf(self, tensor, dims):
        return self.inner.to_hf(tensor, self.dims_of(dims))

    def rows_as_ours(self, rows):
        return self.inner.rows_as_ours(rows)

    def rows_as_hf(self, rows):
        return self.inner.rows_as_hf(rows)

    def moved(self, move):
        return replace(super().moved(move), inner=self.inner.moved(move))


@dataclass(frozen=True)
class PerLayer(Op):
    """A tensor every decoder layer has, mapped differently in some layers (Gemma 4's full-attention layers: wider
    heads, fewer key/value heads, keys that are the values): ``layers[i]`` maps layer i. ``hf`` lists every HF name
    some layer maps it from, for the tables that ask which HF tensors exist; ``WeightTable.at`` gives a layer's op."""

    layers: tuple[Op, ...] = ()

    def at(self, layer: int) -> Op:
        return self.layers[layer]

    def moved(self, move):
        return replace(super().moved(move), layers=tuple(op.moved(move) for op in self.layers))


@dataclass(frozen=True)
class GatedFusedQKV(FusedQKV):
    """Attention with an output gate (Qwen3-Next, Qwen3.5): HF's ``q_proj`` gives each head [q | gate]; Megatron's
    linear_qkv (``attention_output_gate``) takes per query group [its heads' q | their gates | k | v]."""

    def group_parts(self, dims: Dims) -> tuple[tuple[int, int], ...]:
        (_, q_rows), *kv = super().group_parts(dims)
        return ((0, 2 * q_rows), *kv)

    def _swap(self, tensor: torch.Tensor, dims: Dims, before: tuple[int, int]) -> torch.Tensor:
        """Within each group's q rows, [head, q/gate, dim] ↔ [q/gate, head, dim] (``before``: the order read)."""
        heads = dims.num_heads // dims.num_query_groups
        tail = tensor.shape[1:]
        grouped = tensor.reshape(-1, 2 * heads * dims.head_dim + 2 * dims.head_dim, *tail)
        q, kv = grouped.split([2 * heads * dims.head_dim, 2 * dims.head_dim], dim=1)
        q = q.reshape(q.shape[0], *before, dims.head_dim, *tail).transpose(1, 2)
        return torch.cat([q.reshape(q.shape[0], -1, *tail), kv], dim=1).reshape(-1, *tail)

    def load(self, src, names, shard, dims):
        heads = dims.num_heads // dims.num_query_groups
        return self._swap(super().load(src, names, shard, dims), dims, (heads, 2))

    def to_hf(self, tensor, dims):
        heads = dims.num_heads // dims.num_query_groups
        return super().to_hf(self._swap(tensor, dims, (2, heads)), dims)


@dataclass(frozen=True)
class GatedMLP(Op):
    """gate, up → Megatron's linear_fc1 = [gate; up]. Under TP each rank holds [gate_r; up_r]."""

    def load(self, src, names, shard, dims):
        if shard is not None and shard.dim != 0:
            raise ValueError(f"{self.mca}: linear_fc1 is column-parallel (dim 0), not dim {shard.dim}")
        return torch.cat([_part(src, n, shard) for n in names], dim=0)

    def to_hf(self, tensor, dims):
        return [t.contiguous() for t in torch.chunk(tensor, 2, dim=0)]


@dataclass(frozen=True)
class StackedExpert(Op):
    """One expert's weight out of an HF tensor stacking the layer's experts on dim 0. Qwen3-VL-MoE's hub checkpoints
    store each expert transposed against Megatron's [out, in] (gate_up_proj [E, hidden, 2I], down_proj [E, I, hidden]);
    ``transformers``' own save_pretrained writes its in-memory [E, out, in], as Qwen3.5-MoE's hub checkpoints do
    (``out_in``). Both are read (by where the hidden size sits; the family's own when both sides are the hidden size)
    and the family's is written. ``glu``: the out dimension is [gate; up], which TP splits half by half;
    ``interleaved``: the checkpoint alternates gate and up along it (gpt-oss). A stacked bias ([E, out]) is one
    expert's [out] row."""

    glu: bool = False
    out_in: bool = False
    interleaved: bool = False

    def load(self, src, names, shard, dims):
        base, expert = split_expert(names[0])
        shape = src.shape(base)
        weight = src.get(base, 0, expert, expert + 1)[0]
        if weight.dim() == 2:
            rows, cols = shape[1:]
            transposed = rows == dims.hidden_size if self.glu else cols == dims.hidden_size
            if rows == cols:  # both sides the hidden size: the family's layout
                transposed = not self.out_in
            weight = weight.t() if transposed else weight
        if self.interleaved:
            weight = torch.cat([weight[0::2], weight[1::2]])
        if shard is not None:
            halves = weight.chunk(2, dim=shard.dim) if self.glu else (weight,)
            weight = torch.cat([h.narrow(shard.dim, lo, hi - lo) for h in halves
                                for lo, hi in [shard.bounds(h.shape[shard.dim])]], dim=shard.dim)
        return weight.contiguous()

    def to_hf(self, tensor, dims):
        if self.interleaved:
            tensor = torch.stack(tensor.chunk(2), dim=1).flatten(0, 1)  # [gate; up] -> g0 u0 g1 u1 ...
        if tensor.dim() == 1 or self.out_in:
            return [tensor.contiguous()]
        return [tensor.t().contiguous()]


@dataclass(frozen=True)
class RopeRows(Op):
    """A projection whose rows come in blocks (one per head) ending in ``rope`` rows that transformers rotates in
    halves (rotate_half: dim i pairs with i + rope/2) while Megatron's multi-latent attention first de-interleaves
    them (dim 2i pairs with 2i + 1): Megatron holds those rows interleaved, so that its de-interleave gives back
    transformers' order (GLM-5's MLA). ``block``: rows per block (None: the whole tensor is one block). A rank reads
    the whole tensor: the rows it keeps are permuted first."""

    rope: int = 0
    block: int | None = None

    def _blocks(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.block or tensor.shape[0]
        blocks = tensor.reshape(-1, block, *tensor.shape[1:])
        return blocks[:, : block - self.rope], blocks[:, block - self.rope:]

    def load(self, src, names, shard, dims):
        weight = src.get(names[0])
        rest, rope = self._blocks(weight)
        first, second = rope.chunk(2, dim=1)
        rope = torch.stack([first, second], dim=2).flatten(1, 2)  # x0 y0 x1 y1 ...
        weight = torch.cat([rest, rope], dim=1).reshape(weight.shape)
        if shard is not None:
            lo, hi = shard.bounds(weight.shape[shard.dim])
            weight = weight.narrow(shard.dim, lo, hi - lo)
        return weight.contiguous()

    def to_hf(self, tensor, dims):
        rest, rope = self._blocks(tensor)
        return [torch.cat([rest, rope[:, 0::2], rope[:, 1::2]], dim=1).reshape(tensor.shape).contiguous()]

    def rows_as_ours(self, rows):
        return self.load(DictSource({self.hf[0]: rows}), list(self.hf), None, None)

    def rows_as_hf(self, rows):
        return self.to_hf(rows, None)[0]


def stacked_experts(mca: str, hf: str, out_in: bool = False, interleaved: bool = False) -> list[Op]:
    """Experts at ``mca`` (…local_experts.*) from HF's stacked ``hf``.gate_up_proj / .down_proj (``out_in``: each
    expert stored [out, in], as Megatron holds it; ``interleaved``: gate and up alternate)."""
    return [StackedExpert(f"{mca}.linear_fc1.weight", (f"{hf}.gate_up_proj{EXPERT_SLICE}*",), glu=True, out_in=out_in,
                          interleaved=interleaved),
            StackedExpert(f"{mca}.linear_fc2.weight", (f"{hf}.down_proj{EXPERT_SLICE}*",), out_in=out_in)]


def stacked_expert_biases(mca: str, hf: str, interleaved: bool = False) -> list[Op]:
    """The biases beside stacked experts (gpt-oss: ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, hidden])."""
    return [StackedExpert(f"{mca}.linear_fc1.bias", (f"{hf}.gate_up_proj_bias{EXPERT_SLICE}*",), glu=True,
                          interleaved=interleaved),
            StackedExpert(f"{mca}.linear_fc2.bias", (f"{hf}.down_proj_bias{EXPERT_SLICE}*",))]


def gated_mlp(mca: str, hf: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> list[Op]:
    """A SwiGLU MLP at ``mca`` (…linear_fc1/fc2) from HF's ``hf`` (…gate/up/down); for experts both prefixes
    carry a second ``*`` for the expert index."""
    return [GatedMLP(f"{mca}.linear_fc1.weight", (f"{hf}.{gate}.weight", f"{hf}.{up}.weight")),
            Rename(f"{mca}.linear_fc2.weight", (f"{hf}.{down}.weight",))]


# Every layer's tensors start so, ``*`` the layer index: Megatron side, HF side.
LAYER, HF_LAYER = "decoder.layers.*.", "model.layers.*."
_MOE_TENSORS = (".mlp.router.", ".mlp.experts.", ".mlp.shared_experts.")


def in_moe_layers(mca: str) -> bool | None:
    """Which layers hold a layer tensor in models mixing dense and MoE layers (DeepSeek's, GLM's first layers are
    dense): True only the MoE layers (router, experts, shared experts), False only the dense ones (their MLP), None
    every layer (attention, norms)."""
    if any(part in mca for part in _MOE_TENSORS):
        return True
    return False if ".mlp.linear_fc" in mca else None


# the two kinds of attention layer in hybrid models (Qwen3-Next, Qwen3.5): gated delta-rule (linear) and full
_LINEAR_ATTENTION = tuple(f".self_attention.{p}" for p in ("in_proj.", "conv1d", "dt_bias", "A_log", "out_norm.",
                                                          "out_proj."))
_FULL_ATTENTION = tuple(f".self_attention.{p}" for p in ("linear_qkv.", "linear_proj.", "q_layernorm.",
                                                        "k_layernorm."))


def in_linear_attention_layers(mca: str) -> bool | None:
    """Like ``in_moe_layers`` for hybrid models: True only the linear-attention layers' tensors, False only the
    full-attention layers', None every layer's."""
    if any(part in mca for part in _LINEAR_ATTENTION):
        return True
    return False if any(part in mca for part in _FULL_ATTENTION) else None


def dense_layer(attn: str = "self_attn", mlp: str = "mlp", qkv_bias: bool = False, gated: bool = False,
                pre_mlp_norm: str = "post_attention_layernorm") -> list[Op]:
    """The Llama-style decoder layer every family here shares (``mlp=""``: the MLP is mapped elsewhere; ``gated``:
    attention with an output gate; ``pre_mlp_norm``: HF's name of the norm before the MLP, Gemma's
    ``pre_feedforward_layernorm``)."""
    qkv = GatedFusedQKV if gated else FusedQKV
    ops: list[Op] = [
        Rename(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",)),
        qkv(LAYER + "self_attention.linear_qkv.weight", tuple(f"{HF_LAYER}{attn}.{p}_proj.weight" for p in "qkv")),
        Rename(LAYER + "self_attention.linear_proj.weight", (f"{HF_LAYER}{attn}.o_proj.weight",)),
        Rename(LAYER + "pre_mlp_layernorm.weight", (f"{HF_LAYER}{pre_mlp_norm}.weight",)),
    ]
    if qkv_bias:
        ops.append(FusedQKV(LAYER + "self_attention.linear_qkv.bias",
                            tuple(f"{HF_LAYER}{attn}.{p}_proj.bias" for p in "qkv")))
    if mlp:
        ops += gated_mlp(LAYER + "mlp", HF_LAYER + mlp)
    return ops


# Canonical names use separate norm modules; Megatron's TE spec fuses each norm into the linear after it and
# names it there. Parameters (loading), dist-checkpoint keys (export) and the native spec's sharded-state-dict
# keys (so checkpoints move between specs) all translate through this one table.
NORM_ALIASES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def _rename_norm(name: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        if f".{old}" in name:
            return name.replace(f".{old}", f".{new}", 1)
    return name


def te_norm_name(name: str) -> str:
    """``….input_layernorm.weight`` → ``….self_attention.linear_qkv.layer_norm_weight``; other names unchanged."""
    return _rename_norm(name, list(NORM_ALIASES.items()))


def canonical_norm_name(name: str) -> str:
    """The inverse of ``te_norm_name``."""
    return _rename_norm(name, [(te, ours) for ours, te in NORM_ALIASES.items()])


def embeddings(tied: bool, mtp_layers: range = range(0)) -> list[Op]:
    """The embedding, final norm and output layer. ``mtp_layers``: the HF layer indices of multi-token-prediction
    layers, whose checkpoint entries repeat the embedding and the output layer (``embed_tokens``,
    ``shared_head.head``); Megatron's MTP shares the model's, so those copies are written back and never read."""
    embed = ["model.embed_tokens.weight"] + [f"model.layers.{i}.embed_tokens.weight" for i in mtp_layers]
    heads = [f"model.layers.{i}.shared_head.head.weight" for i in mtp_layers]
    return [
        Rename("embedding.word_embeddings.weight", tuple(embed + (heads if tied else [])), vocab=True),
        Rename("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rename("output_layer.weight", ("model.embed_tokens.weight",) if tied else ("lm_head.weight", *heads),
               vocab=True, export=not tied),
    ]


# Multi-token prediction (DeepSeek-V3, GLM-4.5). Megatron builds MTP layer k as ``mtp.layers.<k>.`` around a
# ``transformer_layer``; HF checkpoints store it as decoder layer ``num_layers + k``. Canonically it is that decoder
# layer: its transformer layer's tensors take the decoder-layer names (and ops), the MTP parts sit under ``mtp.``.
MTP_PARTS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "shared_head.norm"}
_MTP_LOCAL = re.compile(r"^mtp\.layers\.(\d+)\.(transformer_layer\.)?(.*)$")
_MTP_CANONICAL = re.compile(r"^decoder\.layers\.(\d+)\.(mtp\.)?(.*)$")


def mtp_ops() -> list[Op]:
    """The MTP layers' own tensors (their transformer layers map as decoder layers)."""
    return [Rename(f"{LAYER}mtp.{ours}.weight", (f"{HF_LAYER}{theirs}.weight",)) for ours, theirs in MTP_PARTS.items()]


# Qwen3-Next and Qwen3.5 keep their MTP layer under ``mtp.``: its decoder layer as ``mtp.layers.<k>.``, its parts as
# below, and no copies of the embedding or output layer. Canonically (in the ops) it is still decoder layer
# ``num_layers + k`` with DeepSeek's part names; ``mtp_module_names`` renames at the checkpoint's edge.
MTP_MODULE_PARTS = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
                    "shared_head.norm": "norm"}


def mtp_module_names(layer_prefix: str, num_layers: int) -> Callable[[str], str]:
    """Canonical HF name → the name in a checkpoint that stores its MTP layers under ``mtp.``; ``layer_prefix``: where
    the decoder layers are (``model.layers.``, or ``model.language_model.layers.`` in a vision-language model)."""

    def stored(name: str) -> str:
        index, _, rest = name[len(layer_prefix):].partition(".") if name.startswith(layer_prefix) else ("", "", "")
        if not index.isdigit() or int(index) < num_layers:
            return name
        part = rest.removesuffix(".weight")
        if part in MTP_MODULE_PARTS:
            return f"mtp.{MTP_MODULE_PARTS[part]}.weight"
        return f"mtp.layers.{int(index) - num_layers}.{rest}"

    return stored


def is_mtp_only(pattern: str) -> bool:
    return pattern.startswith(f"{LAYER}mtp.")


def canonical_mtp_name(name: str, num_layers: int) -> str:
    """``mtp.layers.k.transformer_layer.X`` → ``decoder.layers.<num_layers + k>.X``; ``mtp.layers.k.enorm.weight`` →
    ``decoder.layers.<num_layers + k>.mtp.enorm.weight``; other names unchanged."""
    match = _MTP_LOCAL.match(name)
    if match is None:
        return name
    layer, inner, rest = int(match.group(1)) + num_layers, match.group(2), match.group(3)
    return f"decoder.layers.{layer}.{rest}" if inner else f"decoder.layers.{layer}.mtp.{rest}"


def stored_mtp_name(name: str, num_layers: int) -> str:
    """The inverse of ``canonical_mtp_name`` for layers past ``num_layers``: the name Megatron's MTP block uses."""
    match = _MTP_CANONICAL.match(name)
    if match is None or int(match.group(1)) < num_layers:
        return name
    k, mtp_part, rest = int(match.group(1)) - num_layers, match.group(2), match.group(3)
    return f"mtp.layers.{k}.{rest}" if mtp_part else f"mtp.layers.{k}.transformer_layer.{rest}"


class WeightTable:
    """Looks ops up by canonical Megatron name (with concrete indices) and lists every HF name they cover.
    ``stored``: canonical HF name → the checkpoint's, where a family stores some tensors elsewhere (MTP layers under
    ``mtp.``); the ops stay canonical."""

    def __init__(self, ops: list[Op], stored: Callable[[str], str] | None = None) -> None:
        self.ops = ops
        self.stored = stored or (lambda name: name)
        self._by_mca = {op.mca: op for op in ops}
        if len(self._by_mca) != len(ops):
            raise ValueError("two ops map the same Megatron tensor")

    @staticmethod
    def pattern_of(name: str) -> tuple[str, tuple[int, ...]]:
        """``decoder.layers.3.mlp.experts.local_experts.5.x`` →
        (``decoder.layers.*.mlp.experts.local_experts.*.x``, (3, 5))."""
        parts, indices = [], []
        for part in name.split("."):
            if part.isdigit():
                parts.append("*")
                indices.append(int(part))
            else:
                parts.append(part)
        return ".".join(parts), tuple(indices)

    def lookup(self, mca_name: str) -> tuple[Op, list[str]]:
        pattern, indices = self.pattern_of(mca_name)
        op = self._by_mca.get(pattern)
        if op is None:
            raise KeyError(f"no weight mapping for Megatron tensor {mca_name!r}")
        op = self.at(op, indices)
        return op, [self.stored(fill(p, indices[: p.count("*")])) for p in op.hf]

    @staticmethod
    def at(op: Op, indices: tuple[int, ...]) -> Op:
        """The op that maps the tensor at ``indices`` (its layer's, where the op differs between layers)."""
        return op.at(indices[0]) if isinstance(op, PerLayer) else op
