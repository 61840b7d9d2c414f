"""MoE token routing without a host synchronisation, where every expert is on this rank.

With expert parallelism and expert tensor parallelism both 1, Megatron's dispatchers still move data-dependent
sizes to the host: the unfused ``permute`` selects tokens with ``masked_select`` (its output size is only known
on the host), and the token counts per expert are copied to the host for the expert GEMMs. Each copy waits for
the GPU to drain, once or more per MoE layer and micro-batch, which leaves the GPU idle while Python runs ahead
(perf-notes: three syncs per MoE layer per micro-batch).

Without token dropping, a token goes to exactly ``topk`` experts, so the permuted size is static
(tokens x topk) and the order can be computed on the device: sort the (expert, token) pairs by expert, tokens
ascending inside each expert — exactly the order of Megatron's ``permute``, so the numbers are the same. The
counts per expert stay on the device and reach ``torch._grouped_mm`` as its offsets (``experts.py``).

Both directions move rows by gathers, never by a scatter-add: a token's ``topk`` rows are found through the
inverse of the sort, so summing them (the combine, and the permute's backward) is a gather of ``topk`` rows per
token and a sum over them, on GPUs one Triton kernel that sums the rows as it reads them (``combine_triton.py``).
Megatron's ``index_add`` / ``scatter_add`` does the same sum with atomic bf16 adds, eight per output row, at a
fraction of the GPU's bandwidth (0.54 ms a call on the Qwen3-30B-A3B shape); on one H200 the 8-layer step of that
shape went from 749 to 656 ms. The sum here is in fp32, rounded once.

``LocalDispatchLayer`` (a TransformerLayer: its MoE layer stays Megatron's own class, which TransformerLayer passes
its process groups to) installs the dispatcher where it applies and keeps Megatron's otherwise (expert parallelism,
capacity factors, padding for quantisation, shared-expert overlap, latent projections, or the recipe's
``moe_local_dispatch: false``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.transformer_layer import TransformerLayer

from . import combine_triton
from .moe_block import MoEBlock, moe_block
from .sublayers import PostNormMLP


def local_dispatch_applies(c, ep_size: int, expert_tp_size: int) -> bool:
    """Whether ``LocalDispatchLayer`` routes MoE tokens on the device for this config and expert parallel sizes."""
    return (getattr(c, "moe_local_dispatch", None) is not False and ep_size == 1 and expert_tp_size == 1
            and c.moe_expert_capacity_factor is None and not c.moe_pad_expert_input_to_capacity
            and not getattr(c, "moe_router_padding_for_quantization", False)
            and not c.moe_shared_expert_overlap and not getattr(c, "moe_latent_size", None))


class LocalTokenDispatcher(MoETokenDispatcher):
    """All experts local, no token dropped: permute and unpermute by a device-side sort, no host sync."""

    def __init__(self, replaced: MoETokenDispatcher) -> None:
        # the replaced dispatcher's config and process groups (MoETokenDispatcher.__init__'s fields)
        self.__dict__.update({k: getattr(replaced, k) for k in (
            "config", "shared_experts", "ep_group", "tp_group", "tp_ep_group", "tp_size", "tp_rank", "ep_size",
            "cudagraph_attrs", "valid_cudagraph_attrs")})
        self.num_experts, self.topk = self.config.num_moe_experts, self.config.moe_router_topk

    @staticmethod
    def applies(layer: MoELayer) -> bool:
        d = layer.token_dispatcher
        return d is not None and local_dispatch_applies(layer.config, d.ep_size, d.tp_size)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        tokens = routing_map.size(0)
        with torch.no_grad():
            # The topk experts of each token (a routing map row has exactly topk entries without dropping), as
            # (expert, token) keys sorted by expert, tokens ascending within an expert: Megatron's permute order.
            experts = routing_map.to(torch.int8).topk(self.topk, dim=1, sorted=False).indices
            keys = experts * tokens + torch.arange(tokens, device=experts.device).unsqueeze(1)
            keys, pairs = keys.reshape(-1).sort()  # pairs: where each sorted row came from, token·topk + i
            self.token_index = keys % tokens
            expert_index = keys // tokens
            self.prob_index = self.token_index * self.num_experts + expert_index
            self.tokens_per_expert = routing_map.sum(dim=0, dtype=torch.int64)
            # the inverse: token t's rows in expert order are rows_of_token[t·topk : (t+1)·topk]
            self.rows_of_token = torch.empty_like(pairs)
            self.rows_of_token[pairs] = torch.arange(pairs.numel(), device=pairs.device)
        return hidden_states, probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        permuted = _Spread.apply(hidden_states, self.token_index, self.rows_of_token, self.topk)
        permuted_probs = probs.reshape(-1).index_select(0, self.prob_index)
        return permuted, self.tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(hidden_states, self.token_index, self.rows_of_token, self.topk)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)


def _sum_rows_of_each_token(rows: torch.Tensor, rows_of_token: torch.Tensor, topk: int) -> torch.Tensor:
    """``[tokens·topk, h]`` rows in expert order → ``[tokens, h]``: each token's rows summed (fp32 accumulation)."""
    if rows.is_cuda:
        return combine_triton.gather_sum(rows, rows_of_token, topk)
    return rows.index_select(0, rows_of_token).view(-1, topk, rows.size(-1)).sum(1)


class _Spread(torch.autograd.Function):
    """Each token copied to its ``topk`` rows in expert order; backward: each token's row gradients summed."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, token_index: torch.Tensor, rows_of_token: torch.Tensor,
                topk: int) -> torch.Tensor:
        ctx.save_for_backward(rows_of_token)
        ctx.topk = topk
        return tokens.index_select(0, token_index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows_of_token,) = ctx.saved_tensors
        return _sum_rows_of_each_token(grad, rows_of_token, ctx.topk), None, None, None


class _Gather(torch.autograd.Function):
    """The experts' rows back to their tokens, each token's ``topk`` rows summed; backward: the token's gradient
    copied to each of its rows."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, token_index: torch.Tensor, rows_of_token: torch.Tensor,
                topk: int) -> torch.Tensor:
        ctx.save_for_backward(token_index)
        return _sum_rows_of_each_token(rows, rows_of_token, topk)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token_index,) = ctx.saved_tensors
        return grad.index_select(0, token_index), None, None, None


class LocalDispatchLayer(TransformerLayer):
    """Megatron's TransformerLayer whose MoE layer (if any) routes with ``LocalTokenDispatcher`` where it applies,
    and whose dense MLP is normalised on its way out where the model has post norms (``sublayers.PostNormMLP``), and
    whose MoE layer is Gemma 4's block where the model has it (``moe_block.py``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.mlp, MoELayer) and LocalTokenDispatcher.applies(self.mlp):
            self.mlp.token_dispatcher = LocalTokenDispatcher(self.mlp.token_dispatcher)
        if isinstance(self.mlp, MoELayer) and moe_block(self.config):
            MoEBlock.attach(self.mlp)  # with its own norms, the post norm among them
        elif getattr(self.config, "post_layer_norms", False):
            if type(self.mlp) is not MLP:
                raise ValueError(f"post_layer_norms on a {type(self.mlp).__name__}: only dense MLPs have them here.")
            PostNormMLP.attach(self.mlp)
