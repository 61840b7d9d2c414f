"""DeepSeek sparse attention (GLM-5, ``glm_moe_dsa``) on PyTorch kernels, without Transformer Engine.

Megatron's multi-latent attention hands its core attention the layer's input and its low-rank query beside q, k and
v (``x``, ``qr``: its ``experimental_attention_variant="dsa"`` call). The lightning indexer scores every earlier key
of the query's sequence and keeps the best ``index_topk``; the attention sees only those. A sequence no longer than
``index_topk`` keeps every key: its attention is the dense causal one.

The indexer is transformers' (``GlmMoeDsaIndexer``), so the keys chosen are LLaMA-Factory's:
``score(s, t) = sum_h w_h(s) relu(q_h(s) . k(t) / sqrt(d))`` with ``w = weights_proj(x) / sqrt(heads)``, RoPE on the
*first* ``qk_rope_head_dim`` dims of q and k in halves (rotate_half), k through a LayerNorm, in fp32; no Hadamard
rotation (orthogonal: the same scores). transformers computes it without gradient, so LLaMA-Factory's default path
never trains it; here its weights are frozen. (Megatron's own ``DSAttention`` differs: RoPE on the last dims,
a Hadamard kernel from ``fast_hadamard_transform``, a KL loss that trains the indexer, no packing.)

Every query first attends densely (the dense layers' kernels, one call for the whole micro-batch): a query among the
first ``index_topk`` of its sequence (a padded row, a packed document) sees all its keys anyway, and most fine-tuning
documents are shorter than that. Only a longer sequence's later queries attend again, sparsely: in chunks that bound
the indexer's scores they pick their keys, then attend over them (SDPA with a boolean mask; the chunks of a long
sequence are recomputed in the backward instead of keeping their scores). On a GPU SDPA's fused kernels never hold
the scores, so an attention chunk spans many of the indexer's and is bounded by its mask instead: every chunk reads
K and V once, and fewer chunks read them fewer times (on an H200, 8k tokens: 84 ms forward + backward against 116
in the indexer's chunks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils.checkpoint import checkpoint

from .attention import NativeDotProductAttention


# query rows per chunk: the indexer's fp32 scores are rows x heads x keys, the math attention's (CPU) heads x rows
# x keys
_SCORE_BYTES = 256 * 2**20
# on a GPU, query rows per attention chunk: its mask (rows x keys) as SDPA's fused kernels take it, in bf16
_MASK_BYTES = 64 * 2**20


class LightningIndexer(MegatronModule):
    """transformers' indexer weights under Megatron's names (Megatron-Bridge's too): ``linear_wq_b`` (the low-rank
    query to the indexer's heads), ``linear_wk`` (the input to its one key head), ``k_norm`` (a LayerNorm with bias),
    ``linear_weights_proj`` (the input to a weight per head). Whole on every tensor-parallel rank, frozen."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config=config)
        self.heads, self.head_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.rope_dim, self.topk = config.qk_pos_emb_head_dim, config.dsa_indexer_topk
        self.rotary_base = config.rotary_base
        q_in = config.q_lora_rank or config.hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        made = dict(device=device, dtype=config.params_dtype)
        self.linear_wq_b = torch.nn.Linear(q_in, self.heads * self.head_dim, bias=False, **made)
        self.linear_wk = torch.nn.Linear(config.hidden_size, self.head_dim, bias=False, **made)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=1e-6, **made)
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, self.heads, bias=False, **made)
        for param in self.parameters():
            param.requires_grad_(False)
            param.no_gradient = True  # never trained: freeze-tuning keeps it so in the layers it trains

    @torch.no_grad()
    def queries_keys(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor):
        """Per token (``x`` [n, hidden], ``qr`` [n, q_lora], ``positions`` [n]): q [n, heads, d], k [n, d] with
        RoPE applied, the heads' weights [n, heads]; fp32."""
        x, qr = x.float(), qr.float()
        q = F.linear(qr, self.linear_wq_b.weight.float()).view(-1, self.heads, self.head_dim)
        k = F.layer_norm(F.linear(x, self.linear_wk.weight.float()), (self.head_dim,),
                         self.k_norm.weight.float(), self.k_norm.bias.float(), self.k_norm.eps)
        cos, sin = self._rope(positions)
        q = torch.cat([_rotate(q[..., : self.rope_dim], cos[:, None], sin[:, None]), q[..., self.rope_dim:]], -1)
        k = torch.cat([_rotate(k[..., : self.rope_dim], cos, sin), k[..., self.rope_dim:]], -1)
        weights = F.linear(x, self.linear_weights_proj.weight.float()) * self.heads ** -0.5
        return q, k, weights

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / self.rotary_base ** (
            torch.arange(0, self.rope_dim, 2, dtype=torch.float32, device=positions.device) / self.rope_dim)
        angles = positions.float()[:, None] * inv_freq[None]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def select(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, rows: slice) -> torch.Tensor:
        """The chosen keys [len(rows), min(topk, keys)] of one sequence's query ``rows`` (all keys before them)."""
        keys = rows.stop
        scores = torch.einsum("shd,td->sht", q[rows], k[:keys]) * self.head_dim ** -0.5
        scores = torch.einsum("sht,sh->st", scores.relu_(), weights[rows])
        scores.masked_fill_(~causal(rows, q.device), float("-inf"))
        # equal scores (a ReLU can zero every head's) go to the earlier key: a stable sort, not topk, whose choice
        # among ties depends on the tensor's length, which differs between a padded row and a packed document
        return scores.sort(dim=-1, descending=True, stable=True).indices[:, : self.topk]


class NativeSparseAttention(MegatronModule):
    """The core attention of a DSA layer: the indexer's keys, then attention over them (see the module's doc)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None) -> None:
        super().__init__(config=config)
        self.indexer = LightningIndexer(config)
        # (Megatron's Attention builds one without a scale first, which MLA replaces with one given its own)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.tp_group = getattr(pg_collection, "tp", None)  # None: Megatron's, asked where SP needs it
        # every query up to the index_topk-th of its sequence sees all its keys: the dense kernels' causal attention
        self.dense = NativeDotProductAttention(config, layer_number, attn_mask_type, attention_type,
                                               attention_dropout, self.softmax_scale, cp_comm_type, pg_collection,
                                               k_channels, v_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, x: torch.Tensor,
                qr: torch.Tensor, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        """Dense causal attention for every query (one call of the dense kernels), then the queries past the
        ``index_topk``-th of a longer sequence attend again over their chosen keys only."""
        dense = self.dense(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                           packed_seq_params=packed_seq_params)
        topk = self.indexer.topk
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        longest = (packed_seq_params.max_seqlen_q or None) if packed else query.size(0)
        if isinstance(longest, int) and longest <= topk:  # no sequence longer than the keys kept: all dense
            return dense
        group = (self.tp_group or parallel_state.get_tensor_model_parallel_group()) if self.config.sequence_parallel \
            else None
        if group is not None and group.size() > 1:  # the indexer sees the whole sequence
            x = gather_from_sequence_parallel_region(x.detach(), group=group)
            qr = gather_from_sequence_parallel_region(qr.detach(), group=group)
        heads, dv = value.shape[-2:]
        if packed:  # [t, heads, d]; every document its own sequence
            cu = (packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None
                  else packed_seq_params.cu_seqlens_q)
            bounds = cu.tolist()
            q, k, v, rows = query, key, value, dense.view(-1, heads, dv)
            x, qr = x.reshape(-1, x.size(-1)), qr.reshape(-1, qr.size(-1))
        else:  # [s, b, heads, d]: each row a sequence, the tokens row after row
            s, b = query.shape[:2]
            bounds = [row * s for row in range(b + 1)]
            q, k, v = (t.transpose(0, 1).reshape(s * b, *t.shape[2:]) for t in (query, key, value))
            x, qr = (t.transpose(0, 1).reshape(s * b, t.size(-1)) for t in (x, qr))
            rows = dense.view(s, b, heads, dv).transpose(0, 1).reshape(s * b, heads, dv)
        pieces, done = [], 0
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi - lo > topk:  # its first topk queries' dense rows stand; the later ones are the sparse ones
                pieces += [rows[done: lo + topk], self._sequence(q[lo:hi], k[lo:hi], v[lo:hi], x[lo:hi], qr[lo:hi])]
                done = hi
        out = torch.cat(pieces + [rows[done:]], dim=0)
        if packed:
            return out.reshape(out.size(0), -1)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _sequence(self, q, k, v, x, qr) -> torch.Tensor:
        """One sequence longer than ``index_topk``: [n, heads, d] in, the outputs of its queries past the
        ``index_topk``-th [n - topk, heads, dv] out."""
        n = q.size(0)
        iq, ik, weights = self.indexer.queries_keys(x, qr, torch.arange(n, device=q.device))
        picked = max(1, _SCORE_BYTES // (4 * n * self.indexer.heads))
        if _fused_sdpa(q):
            rows = max(picked, _MASK_BYTES // (2 * n))
        else:  # SDPA's math path holds heads x rows x keys scores
            rows = max(1, _SCORE_BYTES // (4 * n * max(self.indexer.heads, q.size(1))))
        first = self.indexer.topk
        outs = []
        for start in range(first, n, rows):
            chunk = slice(start, min(n, start + rows))
            allowed = torch.cat([self._allowed(iq, ik, weights, slice(lo, min(chunk.stop, lo + picked)), chunk.stop)
                                 for lo in range(chunk.start, chunk.stop, picked)])
            args = (q[chunk], k[: chunk.stop], v[: chunk.stop], allowed)
            long = n - first > rows and torch.is_grad_enabled()  # several chunks: each recomputed in the backward
            outs.append(checkpoint(self._attend, *args, use_reentrant=False) if long else self._attend(*args))
        return torch.cat(outs, dim=0)

    def _allowed(self, iq, ik, weights, rows: slice, keys: int) -> torch.Tensor:
        """[rows, keys] True where a query attends: its chosen keys, never a later one."""
        earlier = causal(rows, iq.device, keys)
        chosen = torch.zeros_like(earlier).scatter_(1, self.indexer.select(iq, ik, weights, rows), True)
        return chosen & earlier

    def _attend(self, q, k, v, allowed) -> torch.Tensor:
        # [1, heads, rows, d]: SDPA's fused kernels take 4-D inputs only (3-D ones run the math path, scores held)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None], scale=self.softmax_scale)
        return out[0].transpose(0, 1)


def _fused_sdpa(q: torch.Tensor) -> bool:
    """Whether SDPA under a mask runs a fused kernel (memory-efficient attention), which never holds the scores."""
    return q.is_cuda


def causal(rows: slice, device, keys: int | None = None) -> torch.Tensor:
    """[rows, keys (up to the last row unless given)] True where the key is not after the query."""
    return (torch.arange(keys or rows.stop, device=device)[None]
            <= torch.arange(rows.start, rows.stop, device=device)[:, None])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def sparse_attention(config: TransformerConfig) -> bool:
    return getattr(config, "experimental_attention_variant", None) == "dsa"
