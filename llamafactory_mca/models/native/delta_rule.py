"""The chunked gated delta rule in plain torch: the recurrence of Qwen3-Next's and Qwen3.5's linear-attention layers
where flash-linear-attention's kernel cannot run (CPUs; Hopper GPUs with Triton 3.4 to 3.7.0).

The math is transformers' ``torch_chunk_gated_delta_rule`` (chunks of 64 tokens, fp32, l2-normalised q and k, a zero
state per sequence); the arrangement is for speed, because that function is most of a Qwen3-Next step on a GPU:

- inside a chunk, transformers' 63-step forward substitution (``(I + L)^-1`` row by row, each step a handful of
  kernels in the forward and again in the backward) is one batched unit-triangular solve;
- packed sequences are cut into chunks of their own, each sequence padded to a multiple of 64 rather than to the
  longest sequence of the pack, so the in-chunk work is done once per real chunk;
- only the state recurrence goes chunk by chunk: two small matmuls per step over the sequences that still have
  chunks (sorted longest first, so they are a prefix and every slice is a view); the outputs of all chunks are then
  two batched matmuls.
"""

from __future__ import annotations

import torch


CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``l2norm`` (eps inside the square root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       cu_seqlens: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """[b, s, nv, dv] in v's dtype, from q, k [b, s, nk, dk], v [b, s, nv, dv], g (log decay) and beta [b, s, nv].
    Value head j reads key head j // (nv / nk). Without ``cu_seqlens`` each row is one sequence; with it (b = 1) the
    row holds the packed sequences it bounds, and each starts from a zero state."""
    b, s, heads, dv = v.shape
    dk, dtype = k.shape[-1], v.dtype
    q, k = (l2norm(t.float()).repeat_interleave(heads // t.shape[2], dim=2) for t in (q, k))
    q = q * dk**-0.5
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, b * s + 1, s, device=v.device)
    slot, steps = _chunk_layout(cu_seqlens, chunk)

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [b, s, h, ...] -> [chunks, h, chunk, ...], zeros past the ends
        t = t.reshape(b * s, *t.shape[2:]).float()
        rows = t.new_zeros(steps[-1][0] * chunk, *t.shape[1:]).index_put((slot,), t)
        return rows.view(-1, chunk, *t.shape[1:]).transpose(1, 2)

    q, k, v, g, beta = map(chunked, (q, k, v, g, beta))
    g = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    within = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    # (I + within)^-1 applied to beta * v and to the decayed beta * k: the chunk's corrected values and key weights
    solved = torch.linalg.solve_triangular(within, torch.cat([v * beta[..., None], k_beta * g.exp()[..., None]], -1),
                                           upper=False, unitriangular=True)
    u, w = solved.split([dv, dk], -1)
    g_last = g[..., -1]
    k_to_end = k * (g_last[..., None] - g).exp()[..., None]

    state = v.new_zeros(steps[0][1], heads, dk, dv)
    before, fresh = [], []
    for start, active in steps[:-1]:
        rows = slice(start, start + active)
        state = state[:active]
        before.append(state)
        new = u[rows] - w[rows] @ state
        fresh.append(new)
        state = state * g_last[rows].exp()[..., None, None] + k_to_end[rows].transpose(-1, -2) @ new
    before, fresh = torch.cat(before), torch.cat(fresh)
    out = (q * g.exp()[..., None]) @ before + ((q @ k.transpose(-1, -2)) * decay) @ fresh
    return out.transpose(1, 2).reshape(-1, heads, dv)[slot].view(b, s, heads, dv).to(dtype)


def _chunk_layout(cu_seqlens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Chunks laid out step by step: step j holds chunk j of every sequence that has one, longest sequences first.
    Returns each token's slot (its chunk's index x ``chunk`` + its offset in the chunk) and the steps as (first chunk,
    sequences), closed by (all chunks, 0). One host sync, for the sequence lengths."""
    lengths = cu_seqlens.diff().tolist()
    counts = torch.tensor([-(-n // chunk) for n in lengths])
    order = counts.argsort(descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))
    active = (counts[None, :] > torch.arange(int(counts.max()))[:, None]).sum(1)  # sequences with a chunk j
    starts = torch.cat([active.new_zeros(1), active.cumsum(0)])
    device = cu_seqlens.device
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    offset = torch.arange(len(sequence), device=device) - cu_seqlens[:-1].long()[sequence]
    chunk_index = starts.to(device)[offset // chunk] + rank.to(device)[sequence]
    return chunk_index * chunk + offset % chunk, list(zip(starts.tolist(), active.tolist() + [0]))
