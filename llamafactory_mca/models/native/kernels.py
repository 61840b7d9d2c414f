"""The attention math of the native spec: PyTorch kernels only, no [b, h, s, s] score matrix.

Two entry points, both taking Megatron's layouts and returning the same:

- ``padded_attention``: ``[s, b, h, d]`` batches through ``F.scaled_dot_product_attention`` (flash or
  memory-efficient kernels on GPU), GQA through ``enable_gqa`` so K/V are never repeated. Plain causal rows go to
  cuDNN's fused attention where it takes them (Hopper and later): measured on an H200 with torch 2.11, forward +
  backward of one 32k sequence in 28 ms against flash's 48 (``benchmarks/attention_bench.py``). A packed
  micro-batch holding one sequence (long-context rows) takes the same path (``one_sequence``).
- ``segment_attention``: packed ``[t, h, d]`` tokens cut into query segments, each attending causally to
  its own key segment. Causality is aligned bottom-right (query ``i`` of a segment of ``lq`` queries sees
  keys ``0 .. i + lk - lq``), which is what flash attention does when ``lq != lk``. Plain packing uses
  square segments (one per sequence); context parallelism uses two segments per sequence whose keys are
  the gathered prefix up to the end of the local chunk (see ``context_parallel.py``). On CUDA it runs
  ``torch.nn.attention.varlen.varlen_attn``; on CPU (and where varlen_attn cannot run) the same math
  loops over the segments with SDPA.

Both take ``window``: a sliding window's left reach (a query sees itself and the ``window`` keys before it; HF's
``sliding_window`` W is ``window = W - 1``, flash attention's ``window_size=(W - 1, 0)``), or None for plain causal.

And ``sink``: a logit per head added to every softmax's denominator with no value (Megatron's ``softmax_type``
``learnable`` / ``off-by-one``; gpt-oss's attention sinks), or None. With a sink each row's output is the plain one
times sigmoid(lse - sink), lse the row's log-sum-exp. On GPUs varlen_attn's forward gives lse; its backward, handed
that output and lse + log(1 + exp(sink - lse)), recomputes exactly the sink softmax's probabilities, so dq, dk and
dv are the sink attention's (``_SinkVarlen``). Elsewhere the scores are computed per segment.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentPlan:
    """Where each query segment and its key segment lie in the packed tensors.

    ``cu_q``/``cu_k`` are int32 on the compute device (varlen_attn); ``q_lens``/``k_lens`` are the same on
    the host (the SDPA loop). ``kv_index``, when set, selects the key/value rows of every key segment from
    the (all-gathered) K/V tensor — context parallelism builds it; plain packing needs none.
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    kv_index: torch.Tensor | None = None


def make_plan(q_lens: list[int], k_lens: list[int], device: torch.device,
              kv_index: torch.Tensor | None = None) -> SegmentPlan:
    """A plan from host-side segment lengths; empty segments are dropped (varlen gains nothing from them)."""
    pairs = [(lq, lk) for lq, lk in zip(q_lens, k_lens) if lq > 0]
    q_lens_t = tuple(lq for lq, _ in pairs)
    k_lens_t = tuple(lk for _, lk in pairs)

    def cumulative(lengths: tuple[int, ...]) -> torch.Tensor:
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        if lengths:
            cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
        return cu.to(device, non_blocking=True)

    return SegmentPlan(cu_q=cumulative(q_lens_t), cu_k=cumulative(k_lens_t), max_q=max(q_lens_t, default=0),
                       max_k=max(k_lens_t, default=0), q_lens=q_lens_t, k_lens=k_lens_t, kv_index=kv_index)


def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, causal: bool,
                     mask: torch.Tensor | None = None, dropout_p: float = 0.0, window: int | None = None,
                     sink: torch.Tensor | None = None) -> torch.Tensor:
    """``[s, b, h, d]`` in, ``[s, b, h*dv]`` out (``dv``: the values' head dim; multi-latent attention's differs
    from the queries' and keys').

    ``mask`` follows Megatron: boolean, True where attention is *forbidden*, broadcastable to
    ``[b, 1, sq, sk]``. It is combined with causality (so a padding-only mask stays causal), and every query
    keeps its own key so that a fully masked padding row cannot produce NaNs.
    """
    sq, b, hq, d = query.shape
    if sink is not None:  # SDPA has no sink: the rows as packed sequences
        if mask is not None or not causal or dropout_p:
            raise ValueError("attention sinks need causal attention without an explicit mask or dropout")
        return _padded_as_segments(query, key, value, scale, window, sink)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d] views
    gqa = key.size(2) != hq
    if mask is None and causal and window is None and not dropout_p and cudnn_usable(q, k, v):
        return _cudnn_causal(q, k, v, scale).permute(2, 0, 1, 3).reshape(sq, b, hq * value.size(-1))
    if query.is_cuda and mask is None and causal and not dropout_p and (
            not _sdpa_fused(q, k, v, gqa) or (window is not None and varlen_usable(query, window))):
        # No fused SDPA kernel takes these operands (the math fallback would materialise [b, h, s, s]), or a
        # sliding window, which flash's varlen kernel takes without a mask.
        return _padded_as_segments(query, key, value, scale, window)
    attn_mask = None
    if mask is not None or (causal and window is not None):
        sk = key.size(0)
        allowed = ~mask.to(torch.bool) if mask is not None else torch.ones(sq, sk, dtype=torch.bool,
                                                                              device=query.device)
        if causal:
            allowed = allowed & _causal_band(sq, sk, window, query.device)
        attn_mask = allowed | torch.eye(sq, sk, dtype=torch.bool, device=query.device)
        causal = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal,
                                         scale=scale, enable_gqa=gqa)
    return out.permute(2, 0, 1, 3).reshape(sq, b, hq * value.size(-1))


def image_look_ahead_mask(blocks: torch.Tensor, seq: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """[b, 1, s, s], True where query i may see key j: causally inside its sequence (``seq`` [b, s]: which packed
    sequence each position is in; None: one per row) within the window's reach, or both in one image block
    (``blocks`` [b, s]: its index, -1 for text), later keys of it too."""
    s = blocks.shape[-1]
    allowed = _causal_band(s, s, window, blocks.device).unsqueeze(0)
    if seq is not None:
        allowed = allowed & (seq[:, :, None] == seq[:, None, :])
    same_image = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    return (allowed | same_image).unsqueeze(1)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """``[b, h, s, d]`` under any mask (``mask``: boolean, True where allowed, or additive; broadcastable to
    [b, h, s, s]): SDPA's memory-efficient kernel takes one, flash's does not. Grouped K/V heads are repeated, one per
    query head, as that kernel wants."""
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def one_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor | None:
    """A packed ``[t, h, d]`` micro-batch that is one causal sequence, through cuDNN as one padded row; None where
    cuDNN does not take it (the caller runs varlen_attn)."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, h, t, d] views
    if not cudnn_usable(q, k, v):
        return None
    return _cudnn_causal(q, k, v, scale)[0].transpose(0, 1).reshape(query.size(0), -1)


def _cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``[b, h, s, d]`` causal attention through SDPA's cuDNN backend (``cudnn_usable`` said it takes them)."""
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.size(1) != q.size(1))


def cudnn_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether cuDNN's fused attention takes these ``[b, h, s, d]`` operands causally: a GPU of compute capability 9
    or later (on Ampere cuDNN is not faster than flash), and SDPA's own cuDNN checks (dtype, head dims, cuDNN
    version). torch 2.11's cuDNN attention over cumulative lengths measured wrong gradients, so packed batches of
    several sequences keep varlen_attn. Not while a CUDA graph is being captured: cuDNN under capture is unmeasured
    here, and the graphed layers replay flash."""
    backends = torch.backends.cuda
    if not q.is_cuda or not cudnn_attention_device(q.device.index) or torch.cuda.is_current_stream_capturing():
        return False
    return backends.can_use_cudnn_attention(backends.SDPAParams(q, k, v, None, 0.0, True, k.size(1) != q.size(1)),
                                            False)


@cache
def cudnn_attention_device(index: int | None = None) -> bool:
    """Whether this process's GPU is one where causal rows go to cuDNN (compute capability 9 or later)."""
    return (torch.cuda.is_available() and torch.cuda.get_device_capability(index)[0] >= 9
            and hasattr(torch.backends.cuda, "can_use_cudnn_attention"))


def _sdpa_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    """Whether SDPA has a flash / memory-efficient / cuDNN kernel for causal attention on these operands."""
    backends = torch.backends.cuda
    try:
        params = backends.SDPAParams(q, k, v, None, 0.0, True, gqa)
    except (AttributeError, TypeError):  # an older torch without these probes: trust SDPA
        return True
    checks = [backends.can_use_flash_attention, backends.can_use_efficient_attention]
    checks += [backends.can_use_cudnn_attention] if hasattr(backends, "can_use_cudnn_attention") else []
    return any(check(params, False) for check in checks)


def _causal_band(lq: int, lk: int, window: int | None, device: torch.device) -> torch.Tensor:
    """True where query ``i`` of ``lq`` may see key ``j`` of ``lk``: causal, aligned bottom-right, and within the
    sliding window's reach where there is one."""
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)
    return allowed if window is None else allowed.triu(lk - lq - window)


def _padded_as_segments(query, key, value, scale: float, window: int | None = None,
                        sink: torch.Tensor | None = None) -> torch.Tensor:
    """A padded batch as ``b`` packed sequences of length ``s`` through varlen_attn."""
    sq, b, hq, d = query.shape
    if sink is None and not varlen_usable(query):
        _warn_once("no fused attention kernel for this padded batch: SDPA's math fallback materialises the scores.")
    plan = make_plan([sq] * b, [sq] * b, query.device)
    out = segment_attention(sbhd_to_thd(query), sbhd_to_thd(key), sbhd_to_thd(value), plan, scale, window, sink)
    return out.reshape(b, sq, -1).transpose(0, 1).contiguous()


def sbhd_to_thd(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, h, d]`` → ``[b·s, h, d]``: a padded batch as ``b`` packed sequences (a copy)."""
    return t.transpose(0, 1).reshape(t.size(0) * t.size(1), t.size(2), t.size(3))


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SegmentPlan,
                      scale: float, window: int | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """``[t_q, hq, d]`` queries against ``[t_k, hk, d]`` keys and ``[t_k, hk, dv]`` values laid out as ``plan``
    says; returns ``[t_q, hq, dv]``."""
    if sink is not None:
        if varlen_usable(query, window) and value.size(-1) == query.size(-1):
            return _SinkVarlen.apply(query, key, value, sink, plan, scale, window)
        return _scores_per_segment(query, key, value, plan, scale, window, sink)
    if varlen_usable(query, window):
        dv = value.size(-1)
        if dv != query.size(-1):  # flash kernels want one head dim: pad the values, drop the padding after
            value = F.pad(value, (0, query.size(-1) - dv))
            return _varlen(query, key, value, plan, scale, window)[..., :dv]
        return _varlen(query, key, value, plan, scale, window)
    return _sdpa_per_segment(query, key, value, plan, scale, window)


def varlen_attn_available() -> bool:
    return _varlen_fn() is not None


@cache
def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn  # here: newer torch only; the ImportError picks the fallback
    except ImportError:
        return None
    return varlen_attn


@cache
def _varlen_causal_kwargs(gqa: bool) -> tuple[tuple[str, object], ...]:
    """Causal (and GQA) keyword arguments for this torch's varlen_attn.

    torch 2.10 takes ``is_causal=True``; 2.11+ expresses causality as ``window_size=(-1, 0)`` (both align
    the mask bottom-right). 2.14 gates GQA behind ``enable_gqa=True``; 2.11 has no such argument and hands
    fewer K/V heads straight to the flash kernel, which supports them natively.
    """
    params = inspect.signature(_varlen_fn()).parameters
    kwargs: dict[str, object] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return tuple(kwargs.items())


@cache
def varlen_windows_available() -> bool:
    """Whether this torch's varlen_attn takes a sliding window (2.11+: ``window_size``)."""
    return varlen_attn_available() and "window_size" in inspect.signature(_varlen_fn()).parameters


def varlen_usable(query: torch.Tensor, window: int | None = None) -> bool:
    """Whether ``varlen_attn`` runs these operands on the GPU (half precision, a head dim flash supports), with
    ``window`` where one is given."""
    if not query.is_cuda or (window is not None and not varlen_windows_available()):
        return False
    usable = (_varlen_fn() is not None and query.dtype in (torch.float16, torch.bfloat16)
              and query.size(-1) <= 256 and query.size(-1) % 8 == 0)
    if not usable:
        _warn_once(f"varlen_attn cannot run here (torch {torch.__version__}, {query.dtype}, head dim "
                   f"{query.size(-1)}); packed attention loops over sequences instead (slower): SDPA, or for heads "
                   "wider than 256 the scores as tensor-core GEMMs with the softmax in fp32.")
    return usable


def _varlen(query, key, value, plan: SegmentPlan, scale: float, window: int | None = None) -> torch.Tensor:
    fn = _varlen_fn()
    kwargs = dict(_varlen_causal_kwargs(key.size(1) != query.size(1)))
    if window is not None:
        kwargs["window_size"] = (window, 0)
    return fn(query.contiguous(), key.contiguous(), value.contiguous(), plan.cu_q, plan.cu_k, plan.max_q,
              plan.max_k, scale=scale, **kwargs)


def bidirectional_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                         cu_k: torch.Tensor, max_q: int, max_k: int, scale: float | None) -> torch.Tensor:
    """``varlen_attn`` without the causal mask (vision towers): ``[t, h, d]`` operands packed as ``cu_q``/``cu_k``
    (int32) say, where ``varlen_usable``."""
    return _varlen_fn()(query.contiguous(), key.contiguous(), value.contiguous(), cu_q, cu_k, max_q, max_k,
                        scale=scale)


# Scores (heads x queries x keys) of one segment that the wide heads' path (``_wide_heads``) holds at most: 128M,
# 512 MB in fp32 while the softmax runs; longer segments take SDPA.
WIDE_HEAD_SCORES = 1 << 27


def _sdpa_per_segment(query, key, value, plan: SegmentPlan, scale: float, window: int | None = None
                      ) -> torch.Tensor:
    gqa = key.size(1) != query.size(1)
    # heads wider than flash and cuDNN take (Gemma 4's 512): SDPA's memory-efficient kernel refuses grouped K/V and
    # its math fallback multiplies in fp32 without tensor cores (one H200, Gemma 4 E2B: a quarter of the GPU's step)
    wide = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.size(-1) > 256
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(plan.q_lens, plan.k_lens):
        q = query[q0:q0 + lq].transpose(0, 1)
        k = key[k0:k0 + lk].transpose(0, 1)
        v = value[k0:k0 + lk].transpose(0, 1)
        if wide and q.size(0) * lq * lk <= WIDE_HEAD_SCORES:
            out = _wide_heads(q, k, v, _causal_band(lq, lk, window, query.device), scale)
        elif lq == lk and window is None:  # square: top-left and bottom-right alignment agree
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            mask = _causal_band(lq, lk, window, query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk
    if q0 != query.size(0):
        raise ValueError(f"the packed batch holds {query.size(0)} query tokens but its segments cover {q0}")
    return torch.cat(outs) if outs else query.new_zeros(*query.shape[:-1], value.size(-1))


def _wide_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
                ) -> torch.Tensor:
    """One segment's attention for heads no fused kernel takes. ``q`` [h, lq, d], ``k``/``v`` [g, lk, d] (each of the
    g key/value heads serves h / g query heads in turn, as SDPA's ``enable_gqa``), ``allowed`` [lq, lk]."""
    h, lq, _ = q.shape
    g = k.size(0)
    pad = -k.size(1) % 8
    if pad:  # keys to a multiple of 8, never attended: a segment of odd length put every GEMM on cuBLAS's unaligned
        # kernels (sm75 CUTLASS, align1: in Gemma 4's H100 profiles)
        k, v, allowed = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), F.pad(allowed, (0, pad))
    out = _WideHeads.apply(q.reshape(g, h // g * lq, -1), k, v, allowed, scale)
    return out.view(h, lq, -1)


def _scores_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` batched, in fp32: half-precision operands on tensor cores with an fp32 result (a 512-wide dot product
    of normed heads reaches hundreds, where bf16 keeps no fraction)."""
    if not a.is_cuda:  # CPUs have no out_dtype GEMM: the same products, summed in fp32
        return torch.bmm(a.float(), b.float())
    return torch.bmm(a, b, out_dtype=torch.float32)


class _WideHeads(torch.autograd.Function):
    """Attention as two batched GEMMs around a softmax, what flash attention computes without its tiling: the scores
    and their gradient in fp32 (tensor cores, fp32 results), the probabilities kept in the operands' precision for
    the value GEMMs and the backward. ``q`` [g, m, d] (a group's query rows), ``k`` [g, lk, d], ``v`` [g, lk, dv]."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, scale):
        g, m, _ = q.shape
        lk = k.size(1)
        scores = _scores_gemm(q, k.transpose(1, 2)).view(g, -1, allowed.size(0), lk)
        if scale != 1.0:  # Gemma 4's normed heads take none: a pass over the fp32 scores saved
            scores.mul_(scale)
        probs = scores.masked_fill_(~allowed, float("-inf")).softmax(-1).to(q.dtype).view(g, m, lk)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale = scale
        return torch.bmm(probs, v)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, probs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_v = torch.bmm(probs.transpose(1, 2), grad)
        grad_probs = _scores_gemm(grad, v.transpose(1, 2))
        if ctx.scale != 1.0:
            grad_probs.mul_(ctx.scale)
        # p * (g - sum(g * p)) in one kernel, torch's own softmax backward, in fp32
        grad_scores = torch._softmax_backward_data(grad_probs, probs.float(), -1, torch.float32).to(q.dtype)
        return torch.bmm(grad_scores, k), torch.bmm(grad_scores.transpose(1, 2), q), grad_v, None, None


def _scores_per_segment(query, key, value, plan: SegmentPlan, scale: float, window: int | None,
                        sink: torch.Tensor) -> torch.Tensor:
    """Attention with a sink per head, each segment's scores computed in fp32 at least (transformers' eager
    attention with ``sinks``): the sink is one more column of the softmax, dropped after it."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(plan.q_lens, plan.k_lens):
        q, k, v = (t.transpose(0, 1).to(dtype) for t in (query[q0:q0 + lq], key[k0:k0 + lk], value[k0:k0 + lk]))
        if k.size(0) != q.size(0):  # grouped-query attention
            k, v = (t.repeat_interleave(q.size(0) // t.size(0), 0) for t in (k, v))
        scores = (q @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~_causal_band(lq, lk, window, query.device), float("-inf"))
        column = sink.to(dtype).view(-1, 1, 1).expand(-1, lq, 1)
        probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        outs.append((probs @ v).transpose(0, 1).to(query.dtype))
        q0, k0 = q0 + lq, k0 + lk
    if q0 != query.size(0):
        raise ValueError(f"the packed batch holds {query.size(0)} query tokens but its segments cover {q0}")
    return torch.cat(outs) if outs else query.new_zeros(*query.shape[:-1], value.size(-1))


class _SinkVarlen(torch.autograd.Function):
    """varlen_attn with a sink logit per head (see the module docstring): torch's own varlen forward and backward
    ops, the output and log-sum-exp adjusted for the sink in between."""

    @staticmethod
    def forward(ctx, query, key, value, sink, plan: SegmentPlan, scale: float, window: int | None):
        q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
        causal, window_size = _op_window(window)
        out, lse, rng = torch.ops.torch_attn._varlen_attn(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
                                                          causal, scale, window_size, **_gqa_kwargs(k, q))
        rows = _rows_first(lse, q)  # [t, h] fp32
        with_sink = torch.logaddexp(rows, sink.float().unsqueeze(0))
        out = (out.float() * (rows - with_sink).exp().unsqueeze(-1)).to(out.dtype)
        lse_sink = with_sink.t().contiguous() if rows is not lse else with_sink
        ctx.save_for_backward(q, k, v, sink, out, lse_sink, rng, plan.cu_q, plan.cu_k)
        ctx.shape = (plan.max_q, plan.max_k, causal, scale, window_size)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sink, out, lse_sink, rng, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, scale, window_size = ctx.shape
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(grad_out, q, k, v, out, lse_sink, cu_q, cu_k, max_q,
                                                                max_k, causal, rng, scale, window_size)
        # the sink's share of each row's softmax times the row's (dO . O), summed over rows, negated
        rows = _rows_first(lse_sink, q)
        d = (grad_out.float() * out.float()).sum(-1)
        grad_sink = -((sink.float().unsqueeze(0) - rows).exp() * d).sum(0)
        return dq, dk, dv, grad_sink.to(sink.dtype), None, None, None


def _op_window(window: int | None) -> tuple[bool, list[int]]:
    """(is_causal, window_size) for torch's varlen op, as varlen_attn passes them."""
    return (True, [-1, 0]) if window is None else (False, [window, 0])


def _gqa_kwargs(key: torch.Tensor, query: torch.Tensor) -> dict:
    """``enable_gqa`` where this torch's op takes it (2.14), for fewer key/value heads than query heads."""
    return {"enable_gqa": True} if _varlen_op_takes_gqa() and key.size(1) != query.size(1) else {}


@cache
def _varlen_op_takes_gqa() -> bool:
    """Read once: every attention layer of every micro-batch asks."""
    return "enable_gqa" in [a.name for a in torch.ops.torch_attn._varlen_attn.default._schema.arguments]


def _rows_first(lse: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The flash kernel's log-sum-exp ([heads, tokens]) as [tokens, heads] (a view), or as it is if it already is."""
    t, h = query.size(0), query.size(1)
    if lse.shape == (h, t):
        return lse.t()
    if lse.shape == (t, h):
        return lse
    raise ValueError(f"varlen_attn's log-sum-exp has shape {tuple(lse.shape)} for {t} tokens of {h} heads")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
