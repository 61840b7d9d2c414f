"""FP8 training without Transformer Engine: the GEMMs of Megatron's parallel linears on ``torch._scaled_mm``.

Megatron reaches FP8 only through TE's modules. Here Megatron's ``ColumnParallelLinear`` and ``RowParallelLinear``
stay what they are (parameters, checkpoint keys, tensor and sequence parallelism, LoRA beside them); only the
function their forward calls for the matmul (``_forward_impl``) is ours in the layers FP8 covers. It keeps Megatron's
communication (the sequence-parallel all-gather, the input gradient's all-reduce or reduce-scatter overlapped with
the weight gradient, the weight gradient added into ``main_grad``) and runs the three GEMMs in FP8:

- forward ``y = x W^T``, input gradient ``dx = dy W`` and, unless ``fp8_wgrad: false``, weight gradient
  ``dW = dy^T x``, each with bf16 (or, into an fp32 ``main_grad``, fp32) output;
- ``fp8: e4m3`` casts everything to E4M3; ``hybrid`` the gradients ``dy`` to E5M2 (range over precision);
- ``fp8_recipe: tensorwise``: one scale per tensor from its current absolute maximum (Megatron's "per-tensor
  current scaling"); ``rowwise``: one per row of each operand along the dimension its GEMM contracts (torchao's
  float8 rowwise), so an outlier token or channel costs only its own row precision; ``delayed``: activations and
  gradients scaled by the maxima of the steps before (``DelayedScales``), weights as tensorwise;
- a tensorwise or delayed weight gradient is added into an fp32 ``main_grad`` inside its GEMM on CUDA
  (``fp8_cublaslt.py``);
- weights, master weights, gradients and checkpoints stay as without FP8: a run resumes with FP8 on or off.

Why torch directly and not torchao's float8 training: torchao converts ``nn.Linear`` modules and leaves the fused
casts to torch.compile of the whole model; Megatron's linears are not ``nn.Linear``, their communication sits inside
the autograd function, and our first steps avoid compiling (``cpu_mode``, the Triton kernels). So the function is
Megatron's with ``torch._scaled_mm`` for its matmuls and one Triton kernel (``fp8_triton.py``) for the casts.

Memory: tensorwise keeps the input for the weight gradient in FP8, already transposed (half of what bf16 keeps; under
sequence parallelism the gathered input, which at TP2 is as many bytes as bf16's local share);
rowwise keeps it in bf16 (its weight gradient needs it scaled along the other dimension); a frozen weight (LoRA's
base) keeps no input at all. A weight's FP8 copies are cast once per optimizer step (``WeightCasts``), into the
trained weight's own memory where the optimizer writes it again from fp32 main weights.

``_scaled_mm`` takes dimensions in multiples of 16: the casts pad the tokens with zero rows (a pack of any length
runs in FP8); a linear whose features are not multiples of 16 runs Megatron's bf16 function instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    dist_all_gather_func,
    dist_reduce_scatter_func,
)
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from . import fp8_cublaslt, wgrad


logger = logging.getLogger(__name__)

EPS = 1e-12  # the smallest absolute maximum a scale is taken from (an all-zero tensor stays zero)
ALIGN = 16  # torch._scaled_mm's rule for every dimension
# the hidden size from which FP8 paid on one H100 (benchmarks/results/h100_fp8/): 1.13x our bf16 at 4096 (Qwen3-8B's
# shape); 0.92x on Qwen3-30B-A3B's and 0.96-0.99x on Qwen3-1.7B's, both 2048 wide
PAYS_FROM = 4096


@dataclasses.dataclass(frozen=True)
class Fp8Training:
    """What FP8 covers in this run: made once from the recipe's keys (``spec.prepare_config``), read by the model
    build (``use_fp8``), the startup summary and the planner."""

    format: str = "e4m3"
    recipe: str = "tensorwise"
    wgrad: bool = True  # the weight gradient's GEMM in FP8 too (Megatron's fp8_wgrad)
    bf16_first: int = 1  # layers kept in bf16 at the start and the end (Megatron's first_last_layers_bf16 and its
    bf16_last: int = 1   # num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16; 0 and 0: every layer)
    amax_history: int = 1  # delayed: steps whose maxima are kept (Megatron's fp8_amax_history_len)
    amax_algo: str = "most_recent"  # delayed: the scale from the last step's maximum, or "max" over the history
    margin: int = 0  # delayed: scales 2^margin below the range (Megatron's fp8_margin)

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def delayed(self) -> bool:
        return self.recipe == "delayed"

    def dtype(self, gradient: bool = False) -> torch.dtype:
        return torch.float8_e5m2 if gradient and self.format == "hybrid" else torch.float8_e4m3fn

    def covers(self, layer_number: int, num_layers: int) -> bool:
        """Whether decoder layer ``layer_number`` (from 1, over the whole model) runs its linears in FP8."""
        return layer_number in self.layers(num_layers)

    def layers(self, num_layers: int) -> range:
        return range(self.bf16_first + 1, num_layers - self.bf16_last + 1)

    def describe(self, num_layers: int, experts: bool, hidden: int) -> str:
        """The startup summary's words (``experts``: the model has grouped MoE experts; ``hidden``: its hidden size,
        below ``PAYS_FROM`` a word that FP8 is not expected to pay)."""
        covered = self.layers(num_layers)
        where = (f"layers {covered.start}-{covered.stop - 1} of {num_layers}" if len(covered) else
                 f"no layer of {num_layers}")
        gemms = ("forward, input and weight gradients" if self.wgrad else
                 "forward and input gradient; weight gradient in bf16")
        grads = ", gradients E5M2" if self.format == "hybrid" else ""
        moe = (", their experts' forward and input gradient rowwise in E4M3 (torch._scaled_grouped_mm, where its "
               "kernel for the rows per expert beats bf16's)" if experts else "")
        narrow = (f" (at hidden size {hidden} expect no gain: the casts cost what the GEMMs save below "
                  f"{PAYS_FROM})" if hidden < PAYS_FROM else "")
        which = "largest" if self.amax_algo == "max" else "last"
        recipe = (f"delayed (activations and gradients scaled by the {which} maximum of {self.amax_history} "
                  f"step{'s' if self.amax_history > 1 else ''} before, weights by their own)" if self.delayed else
                  self.recipe)
        return (f"FP8 {recipe} E4M3{grads} (torch._scaled_mm: {gemms}) on the attention and MLP linears of "
                f"{where}{moe}; embedding, output layer, router, norms and attention scores in bf16{narrow}")


# Megatron's TransformerConfig keys this reads
FIELDS = ("fp8", "fp8_recipe", "fp8_wgrad", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
          "num_layers_at_end_in_bf16", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin")


def from_fields(fields: dict[str, Any]) -> Fp8Training:
    """The settings from Megatron's keys (``FIELDS``) as a recipe sets them; unset, the first and last layers stay
    bf16 (Megatron's default keeps none: its TE recipes run every layer in FP8)."""
    keep = fields.get("first_last_layers_bf16") is not False
    return Fp8Training(format=fields["fp8"], recipe=fields.get("fp8_recipe") or "tensorwise",
                       wgrad=fields.get("fp8_wgrad") is not False,
                       bf16_first=fields.get("num_layers_at_start_in_bf16", 1) if keep else 0,
                       bf16_last=fields.get("num_layers_at_end_in_bf16", 1) if keep else 0,
                       amax_history=fields.get("fp8_amax_history_len") or 1,
                       amax_algo=fields.get("fp8_amax_compute_algo") or "most_recent",
                       margin=fields.get("fp8_margin") or 0)


class Operand(NamedTuple):
    """An FP8 matrix laid out for ``torch._scaled_mm``: rows along the dimension the GEMM contracts, and the scale
    that turns it back (a scalar, or one per row)."""

    data: torch.Tensor  # [rows, contracted], contiguous
    scale_inv: torch.Tensor  # fp32: 0-dim, or [rows, 1]


def _amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x|, over the tensor or along ``dim``: one reduction, in x's dtype (the largest magnitude is exact)."""
    return torch.linalg.vector_norm(x, float("inf"), dim=dim)


def _cast(x: torch.Tensor, amax: torch.Tensor, axis: int, dtype: torch.dtype, rows: bool, cols: bool,
          m_out: int | None = None, seen: torch.Tensor | None = None
          ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The Triton kernel on a GPU, its torch twin elsewhere (``fp8_triton.cast`` says what they return)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if x.is_cuda:
        from .fp8_triton import cast  # here: Triton comes with CUDA builds of torch only

        return cast(x, amax, axis, dtype, rows, cols, m_out, EPS, seen)
    return cast_torch(x, amax, axis, dtype, rows, cols, m_out, seen)


def cast_torch(x: torch.Tensor, amax: torch.Tensor, axis: int, dtype: torch.dtype, rows: bool, cols: bool,
               m_out: int | None = None, seen: torch.Tensor | None = None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The Triton kernel's cast (``fp8_triton.cast``) in torch ops: what CPUs run, and its reference."""
    if seen is not None:
        torch.maximum(seen[:1], _amax(x).float(), out=seen[:1])
    fmax, m = torch.finfo(dtype).max, x.shape[-2]
    m_out = m if m_out is None else m_out
    a = amax.float().clamp(min=EPS)
    scale, inv = fmax / a, a / fmax
    s = scale if axis == 0 else scale.unsqueeze(-1) if axis == 1 else scale.unsqueeze(-2)
    y = (x.float() * s).clamp(-fmax, fmax)
    if m_out > m:
        y = torch.nn.functional.pad(y, (0, 0, 0, m_out - m))
        if axis == 1:
            inv = torch.nn.functional.pad(inv, (0, m_out - m), value=1.0)
    y = y.to(dtype)
    return (y.contiguous() if rows else None), (y.transpose(-2, -1).contiguous() if cols else None), inv


def padded(rows: int) -> int:
    """Rows rounded up to ``_scaled_mm``'s multiple (the casts write the extra rows as zeros)."""
    return -(-rows // ALIGN) * ALIGN


def per_tensor(x: torch.Tensor, dtype: torch.dtype, rows: bool = True, cols: bool = False,
               amax: torch.Tensor | None = None, seen: torch.Tensor | None = None
               ) -> tuple[Operand | None, Operand | None]:
    """``x`` [m, n] under one scale (from its absolute maximum, or ``amax`` taken before): as the operand of a GEMM
    contracting n (``rows``) and of one contracting m (``cols``, its transpose), in one pass, m padded with zero rows
    to the GEMM's multiple (``seen``: raised to x's maximum in that pass)."""
    data, data_t, inv = _cast(x, _amax(x) if amax is None else amax, 0, dtype, rows, cols, padded(x.shape[0]), seen)
    return (Operand(data, inv) if rows else None), (Operand(data_t, inv) if cols else None)


class DelayedScales:
    """Delayed scaling (Megatron's ``fp8_recipe: delayed``): an activation or gradient is scaled by the maximum its
    place in the model reached in the steps before, so its cast is one pass over it, its own maximum recorded on the
    way, instead of a reduction and then the cast. Current scaling's reductions were 4% of the GPU time of a
    Qwen3-8B-shaped LoRA step in FP8 (``h100_lora_fused_add``), 2% of a full fine-tuning one.

    Each covered linear has two places (its input, its output gradient). ``seen`` collects this step's maxima over
    all micro-batches; at the step's end (``roll``, the end of ``WeightCasts.holding``) they join the history and the
    scales the next step uses (``used``) are taken from it, in place (a CUDA graph captured at step 1 reads and
    writes the same tensors every replay). A place that saw no finite non-zero maximum keeps the scale it had, as
    Transformer Engine's recipe does. The first step, with no history yet, scales each tensor by its own maximum
    (current scaling) while recording it, and so does every later step at a place with no maximum yet (``unknown``,
    read at the step's end while there are any: a small copy to the host). Values past a delayed scale's range
    saturate."""

    SLOTS = 64  # per place: the cast kernel's blocks spread their atomic maxima over these

    def __init__(self, fp8: Fp8Training) -> None:
        self.fp8, self.places, self.primed = fp8, 0, False
        self.unknown: set[int] = set()  # places without a scale yet
        self.seen: torch.Tensor | None = None  # [places, SLOTS]: this step's maxima
        self.history: torch.Tensor | None = None  # [amax_history, places]: the steps' before, newest first
        self.used: torch.Tensor | None = None  # [places]: what the casts scale by

    def place(self, count: int = 1) -> int:
        """The first of ``count`` new places."""
        self.places += count
        return self.places - count

    def cast(self, x: torch.Tensor, dtype: torch.dtype, place: int, rows: bool, cols: bool
             ) -> tuple[Operand | None, Operand | None]:
        if self.seen is None:
            self.seen = torch.zeros(self.places, self.SLOTS, dtype=torch.float32, device=x.device)
            self.history = torch.zeros(self.fp8.amax_history, self.places, dtype=torch.float32, device=x.device)
            self.used = torch.zeros(self.places, dtype=torch.float32, device=x.device)
        # a capture records the delayed cast: the graph replays once the history exists (asked only when needed)
        delayed = (self.primed and place not in self.unknown) or (
            x.is_cuda and torch.cuda.is_current_stream_capturing())
        return per_tensor(x, dtype, rows, cols, amax=self.used[place] if delayed else None, seen=self.seen[place])

    @torch.no_grad()
    def roll(self) -> None:
        if self.seen is None:
            return
        seen = self.seen.amax(1)
        newest = torch.where(torch.isfinite(seen) & (seen > 0), seen, self.history[0])  # else the step before's
        if self.history.shape[0] > 1:
            self.history.copy_(torch.roll(self.history, 1, 0))
        self.history[0].copy_(newest)
        known = self.history.amax(0) if self.fp8.amax_algo == "max" else self.history[0]
        self.used.copy_(torch.where(known > 0, known * 2.0 ** self.fp8.margin, self.used))
        self.seen.zero_()
        if self.unknown or not self.primed:  # a known place stays known: once all are, no more copies to the host
            self.unknown = set(torch.nonzero(self.used == 0).flatten().tolist())
        self.primed = True


def per_row(x: torch.Tensor, dtype: torch.dtype, contracted: int) -> Operand:
    """``x`` [m, n] as the operand of a GEMM contracting dimension ``contracted``, a scale per row of that operand
    (contracted 1: x itself, a scale per row of x; 0: x^T, a scale per column of x), m padded with zero rows."""
    if contracted == 1 and x.is_cuda:  # the rows' maxima inside the cast: one pass
        from .fp8_triton import cast_rows  # here: Triton comes with CUDA builds of torch only

        data, inv = cast_rows(x if x.stride(-1) == 1 else x.contiguous(), dtype, padded(x.shape[0]), EPS)
        return Operand(data, inv[:, None])
    amax = _amax(x, dim=contracted)
    data, data_t, inv = _cast(x, amax, 1 if contracted == 1 else 2, dtype, contracted == 1, contracted == 0,
                              padded(x.shape[0]))
    return Operand(data if contracted == 1 else data_t, inv[:, None])


def mm(a: Operand, b: Operand, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``a.data @ b.data^T`` scaled back: [rows of a, rows of b]."""
    scale_b = b.scale_inv.reshape(1, -1) if b.scale_inv.dim() else b.scale_inv
    return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class WeightCasts:
    """The covered weights' FP8 operands, cast once while the weights hold still.

    A weight changes only at the optimizer step, yet every micro-batch's forward and backward would cast it again
    (an absolute maximum and a cast each: a Qwen3-8B layer's 192M weight elements are about as many as the inputs
    and output gradients of its linears at 4,096 tokens, 260M). Inside ``holding()`` (the trainer's forward and
    backward of one step) the first cast of each weight and layout is kept for the step's other micro-batches, and
    for activation recomputation; leaving frees them, before the optimizer changes the weights. Transformer Engine
    keeps its weight casts across micro-batches the same way. Outside it, and while a CUDA graph is captured (a
    replay must cast its own step's weights), every call casts.

    Memory, to the step's end: one FP8 byte per covered weight element from its first forward (the forward's layout)
    and one more from its first backward (the input gradient's), made while the layer's activations are being
    freed. A step of one micro-batch peaks at the end of its forward with the first byte alone; where a second
    micro-batch's forward follows, it peaks there with both (the planner counts them so). Where the optimizer step
    writes every 16-bit weight again from fp32 main weights (``casts_take_weights``, the trainer's decision), the
    step needs no bytes of its own for them (``in_weights``): a trained weight's first forward casts both layouts and
    copies them over the weight's own two bytes per element, which nothing reads again before that write (a step
    that does not update has the trainer write them again, as an update would). Only a pass that an update follows
    lends them (``holding(updates=True)``): an evaluation or a reference model's pass holds its casts apart.

    A frozen weight (LoRA's base, freeze tuning's frozen layers) does not change at the optimizer step: its casts are
    kept for the run, read by every step and by CUDA graphs (captured once, they replay reading the same copies),
    and made again only if the weight is written (its version counter moves: an adapter merged into it).

    Graphed, a replay casts its step's trained weights inside the graph: on the Qwen3-8B shape (8 layers, one H100,
    ``h100_fp8_graphs/call4``) graphed FP8 delayed kept within 0.22% of eager FP8 over 8 steps at 2.2 GiB less.
    """

    def __init__(self, scales: DelayedScales | None = None) -> None:
        self.routed = 0  # the linears and grouped experts that read their operands here
        self.scales = scales  # delayed scaling's maxima, rolled at each step's end
        self.in_weights = False  # a held step's trained-weight casts written into the weights' own memory
        self._held: dict[tuple[int, str], Any] | None = None
        self._lending = False  # inside a held pass that an optimizer step follows, with ``in_weights``
        self._frozen: dict[tuple[int, str], tuple[torch.Tensor, int, Any]] = {}  # (weight, its version, casts)

    @contextlib.contextmanager
    def holding(self, updates: bool = False) -> Iterator[None]:
        """``updates``: an optimizer step follows, writing the trained weights again, so ``in_weights`` may lend
        their bytes; an evaluation's or a reference model's pass reads weights that must come out as they went in."""
        self._held, self._lending = {}, updates and self.in_weights
        try:
            yield
        finally:
            self._held, self._lending = None, False
            if self.scales is not None:
                self.scales.roll()

    def holds(self, weight: torch.Tensor) -> bool:
        return not weight.requires_grad or (
            self._held is not None and not (weight.is_cuda and torch.cuda.is_current_stream_capturing()))

    def get(self, weight: torch.Tensor, layout: str, cast: Callable[[], Any]) -> Any:
        """``cast()``, or what it returned for ``weight`` and ``layout`` earlier in this step (for a frozen weight:
        in this run, while the weight is unchanged)."""
        if not weight.requires_grad:
            key = (id(weight), layout)
            kept = self._frozen.get(key)
            if kept is None or kept[1] != weight._version:
                kept = self._frozen[key] = (weight, weight._version, cast())
            return kept[2]
        if not self.holds(weight):
            return cast()
        key = (id(weight), layout)
        if key not in self._held:
            self._held[key] = cast()
        return self._held[key]

    def operand(self, weight: torch.Tensor, fp8: Fp8Training, rows: bool) -> Operand:
        """``weight`` as the forward's operand (``rows``) or the input gradient's (its transpose), under the recipe's
        weight scaling: held as ``get`` holds it, or, ``in_weights``, both layouts written into the weight itself."""
        if self._lending and weight.requires_grad and self.holds(weight) and _fits_in(weight):
            return self.get(weight, "in weight", lambda: _written_into(weight, _both_layouts(weight, fp8)))[
                0 if rows else 1]
        if fp8.rowwise:
            return self.get(weight, "rows" if rows else "cols", lambda: per_row(weight, fp8.dtype(), 1 if rows else 0))
        return self.tensorwise(weight, fp8.dtype(), rows)

    def tensorwise(self, weight: torch.Tensor, dtype: torch.dtype, rows: bool) -> Operand:
        """``weight`` under one scale, as the forward's operand (``rows``) or the input gradient's (its transpose),
        each layout cast when first asked for; while held, both under the one absolute maximum of the step."""
        amax = self.get(weight, "tensorwise amax", lambda: _amax(weight)) if self.holds(weight) else None
        return self.get(weight, f"tensorwise {rows}",
                        lambda: per_tensor(weight, dtype, rows=rows, cols=not rows, amax=amax)[0 if rows else 1])


def casts_take_weights(half: bool, param_remainders: bool, cpu_offload: bool, overlap_param_gather: bool,
                       gathering_ranks: int, graphed: bool) -> bool:
    """Whether a step's casts of the trained weights may take the weights' own 16-bit memory
    (``WeightCasts.in_weights``): only where the optimizer step writes every 16-bit weight again from fp32 main
    weights kept apart. Not where the 16-bit weight is half of its main weight (``store_param_remainders``), not
    under the CPU-offloading optimizer, and not where the other data-parallel ranks' shards arrive after the step
    (``overlap_param_gather`` over ``gathering_ranks``, dp x cp, of more than one): an evaluation between steps reads
    them. Not under
    ``cuda_graphs`` either: replays cast inside their graphs and hold nothing, so only the eager first step would
    lend, and the graphs are captured from that step's layers before the optimizer writes the weights again."""
    gather_overlapped = overlap_param_gather and gathering_ranks > 1
    return half and not param_remainders and not cpu_offload and not gather_overlapped and not graphed


def _fits_in(weight: torch.Tensor) -> bool:
    """A 16-bit weight has the bytes of both FP8 layouts (its rows need no padding: ``aligned`` routed it here)."""
    return weight.element_size() == 2 and weight.is_contiguous() and weight.shape[0] % ALIGN == 0


def _both_layouts(weight: torch.Tensor, fp8: Fp8Training) -> tuple[Operand, Operand]:
    if fp8.rowwise:
        return per_row(weight, fp8.dtype(), 1), per_row(weight, fp8.dtype(), 0)
    rows, cols = per_tensor(weight, fp8.dtype(), rows=True, cols=True)  # one pass, one absolute maximum
    return rows, cols


def _written_into(weight: torch.Tensor, layouts: tuple[Operand, Operand]) -> tuple[Operand, Operand]:
    """The two FP8 layouts copied over the weight's own bytes (its 16-bit values are gone until the optimizer step
    writes them again from the main weights), through ``.data``: autograd's record of the weight stays as it is."""
    rows, cols = layouts
    flat = weight.data.view(-1).view(rows.data.dtype)
    n = weight.numel()
    into_rows = flat[:n].view(rows.data.shape).copy_(rows.data)
    into_cols = flat[n:].view(cols.data.shape).copy_(cols.data)
    return Operand(into_rows, rows.scale_inv), Operand(into_cols, cols.scale_inv)


def stacked_operand(w: torch.Tensor, dtype: torch.dtype, contracted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' weights ``w`` [experts, k, n] as ``torch._scaled_grouped_mm``'s second operand of a GEMM contracting
    dimension ``contracted`` (1: k, the forward; 2: n, the input gradient): column-major per expert, a scale per
    expert and output column; (operand, its inverse scales)."""
    amax = _amax(w, dim=contracted)
    if contracted == 1:
        _, data_t, inv = _cast(w, amax, 2, dtype, False, True)
        return data_t.transpose(-2, -1), inv
    data, _, inv = _cast(w, amax, 1, dtype, True, False)
    return data.transpose(-2, -1), inv


def grouped_pays(rows_per_expert: float, k: int, n: int) -> bool:
    """Whether an experts' GEMM (``k`` contracted, ``n`` out, ``rows_per_expert`` on average) gains from FP8 on Hopper.
    torch 2.11 picks ``_scaled_grouped_mm``'s CUTLASS tile from the mean rows per expert, k and n
    (``ScaledGroupMM.cu``). Measured against the bf16 grouped GEMM on an H100 (``fp8_bench.py --experts``, 128
    experts of Qwen3-30B-A3B's and Qwen3-235B-A22B's shapes): its 64-row tile, for 128 rows or fewer (or n <= 128),
    1.4-1.9x as fast; with k and n both 2048 or more, 1.3-1.9x at any rows; otherwise its 128 x 256 tile with a K
    step of 64 ran at half bf16's speed from 256 to 1024 rows, and at 2048 rows about even (1.0-1.2x, less its
    casts). Elsewhere that GEMM stays bf16."""
    return rows_per_expert <= 128 or n <= 128 or (k >= 2048 and n >= 2048)


def grouped_mm(a: Operand, b: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype
               ) -> torch.Tensor:
    """Rows of ``a`` grouped by expert (``offs``: where each group ends) times ``b[e]`` (``stacked_operand``)."""
    if a.data.is_cuda:
        return torch._scaled_grouped_mm(a.data, b, a.scale_inv.view(-1), scale_b, offs=offs, out_dtype=out_dtype)
    out, start = [], 0  # CPUs have no grouped FP8 GEMM: the same products expert by expert
    for e, end in enumerate(offs.tolist()):
        out.append(torch._scaled_mm(a.data[start:end], b[e], scale_a=a.scale_inv[start:end],
                                    scale_b=scale_b[e][None, :], out_dtype=out_dtype))
        start = end
    return torch.cat(out)


def _gather(input: torch.Tensor, group: Any) -> torch.Tensor:
    """The sequence-parallel input, whole (into a fresh tensor: Megatron's shared buffer is reused by the next)."""
    shape = list(input.shape)
    shape[0] *= group.size()
    total = torch.empty(shape, dtype=input.dtype, device=input.device)
    dist_all_gather_func(total, input.contiguous(), group=group)
    return total


class _Fp8Linear(torch.autograd.Function):
    """Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` (and, for a frozen weight, its
    ``LinearWithFrozenWeight``) with the three GEMMs in FP8."""

    @staticmethod
    def forward(ctx, input, weight, bias, fp8: Fp8Training, casts: WeightCasts, fuse_wgrad: bool,
                allreduce_dgrad: bool, sequence_parallel: bool, tp_group, place: int = 0):
        total = _gather(input, tp_group) if sequence_parallel else input
        x = total.reshape(-1, total.shape[-1])
        trainable = weight.requires_grad
        keep_t = trainable and fp8.wgrad and not fp8.rowwise  # the input for dW, transposed in FP8, from this pass
        if fp8.rowwise:
            x_rows, x_cols = per_row(x, fp8.dtype(), 1), None
        else:
            x_rows, x_cols = _activation(x, fp8.dtype(), casts, place, cols=keep_t)
        w_rows = casts.operand(weight, fp8, rows=True)
        out = mm(x_rows, w_rows, x.dtype, fast_accum=True)[: x.shape[0]].view(*total.shape[:-1], weight.shape[0])
        if bias is not None:
            out = out + bias
        kept = (x_cols.data, x_cols.scale_inv) if keep_t else (input,) if trainable else ()
        ctx.save_for_backward(weight, *kept)
        ctx.fp8, ctx.casts, ctx.keep_t, ctx.trainable, ctx.use_bias = fp8, casts, keep_t, trainable, bias is not None
        ctx.main_grad = weight.main_grad if fuse_wgrad and hasattr(weight, "main_grad") else None
        ctx.fuse_wgrad, ctx.allreduce_dgrad, ctx.sequence_parallel = fuse_wgrad, allreduce_dgrad, sequence_parallel
        ctx.tp_group, ctx.input_shape, ctx.total_shape, ctx.place = tp_group, input.shape, total.shape, place
        return out

    @staticmethod
    def backward(ctx, grad_output):
        weight, *kept = ctx.saved_tensors
        fp8, casts = ctx.fp8, ctx.casts
        gdt = fp8.dtype(gradient=True)
        g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        wgrad_fp8 = ctx.trainable and fp8.wgrad
        if fp8.rowwise:
            g_rows, g_cols = per_row(g, gdt, 1), None
        else:
            g_rows, g_cols = _activation(g, gdt, casts, ctx.place + 1, cols=wgrad_fp8)
        w_cols = casts.operand(weight, fp8, rows=False)
        total_x = None
        if ctx.trainable and not ctx.keep_t:  # the bf16 input, gathered again under sequence parallelism
            total_x = kept[0]
            if ctx.sequence_parallel:
                total_x = _gather(total_x, ctx.tp_group)
            total_x = total_x.reshape(-1, total_x.shape[-1])
        grad_input = mm(g_rows, w_cols, g.dtype, fast_accum=False)[: g.shape[0]].view(ctx.total_shape)

        handle = None
        if ctx.allreduce_dgrad:  # overlapped with the weight gradient, as Megatron's
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        if ctx.sequence_parallel:
            sub = torch.empty(ctx.input_shape, dtype=grad_input.dtype, device=grad_input.device)
            handle = dist_reduce_scatter_func(sub, grad_input, group=ctx.tp_group, async_op=True)
            grad_input = sub

        grad_weight = None
        if ctx.trainable:
            main_grad = ctx.main_grad
            into = main_grad is not None
            if ctx.fuse_wgrad:
                weight.main_grad = main_grad
            in_gemm = wgrad_fp8 and not fp8.rowwise and into and \
                fp8_cublaslt.accumulate(g_cols.data, g_cols.scale_inv, *kept, main_grad)  # main_grad += dW in one
            if wgrad_fp8 and not in_gemm:
                if fp8.rowwise:  # rowwise GEMMs write bf16 only
                    dw = mm(per_row(g, gdt, 0), per_row(total_x, fp8.dtype(), 0), g.dtype, fast_accum=False)
                else:
                    out_dtype = main_grad.dtype if into else weight.dtype
                    dw = mm(g_cols, Operand(*kept), out_dtype, fast_accum=False)
                if into:
                    main_grad.add_(dw)
                else:
                    grad_weight = dw.to(weight.dtype)
            elif not wgrad_fp8 and into:
                wgrad.wgrad_gemm_accum_fp32(total_x, g, main_grad)
            elif not wgrad_fp8:
                grad_weight = g.t().matmul(total_x)
            if into:
                grad_weight = wgrad.placeholder_grad(weight, g.dtype)
        grad_bias = g.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def _activation(x: torch.Tensor, dtype: torch.dtype, casts: WeightCasts, place: int, cols: bool
                ) -> tuple[Operand | None, Operand | None]:
    """An input or output gradient under one scale: its own maximum's, or under delayed scaling the history's."""
    if casts.scales is None:
        return per_tensor(x, dtype, cols=cols)
    return casts.scales.cast(x, dtype, place, rows=True, cols=cols)


class Fp8ForwardImpl:
    """What a covered linear calls for its matmul (its ``_forward_impl``, Megatron's keyword arguments): FP8 where
    the dimensions allow, else the bf16 function it had."""

    def __init__(self, bf16: Any, fp8: Fp8Training, casts: WeightCasts) -> None:
        self.bf16, self.fp8, self.casts = bf16, fp8, casts
        self.place = casts.scales.place(2) if casts.scales is not None else 0  # its input's; its gradient's next

    def __call__(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                 tp_group=None, grad_output_buffer=None, wgrad_deferral_limit=None, **rest):
        if grad_output_buffer is not None or rest or not aligned(*weight.shape):
            return self.bf16(input=input, weight=weight, bias=bias,
                             gradient_accumulation_fusion=gradient_accumulation_fusion,
                             allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel, tp_group=tp_group,
                             grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit, **rest)
        return _Fp8Linear.apply(input, weight, bias, self.fp8, self.casts, gradient_accumulation_fusion,
                                allreduce_dgrad, sequence_parallel, tp_group, self.place)


def aligned(*dims: int) -> bool:
    unaligned = [d for d in dims if d % ALIGN]
    if unaligned and not aligned.warned:
        aligned.warned = True
        logger.warning("FP8: a layer of %s features (not multiples of %d, torch._scaled_mm's rule) runs in bf16.",
                       dims, ALIGN)
    return not unaligned


aligned.warned = False


def use_fp8(chunks: list[torch.nn.Module], fp8: Fp8Training, num_layers: int) -> WeightCasts:
    """Route the parallel linears and grouped experts of the decoder layers ``fp8`` covers through FP8, their weights'
    casts kept by the one ``WeightCasts`` returned. The multi-token-prediction layers, the output layer and anything
    outside the decoder's layers stay bf16."""
    casts = WeightCasts(DelayedScales(fp8) if fp8.delayed else None)
    for chunk in chunks:
        for name, layer in chunk.named_modules():
            if not isinstance(layer, TransformerLayer) or ".mtp." in f".{name}." or \
                    not fp8.covers(layer.layer_number, num_layers):
                continue
            for module in layer.modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and \
                        not isinstance(module._forward_impl, Fp8ForwardImpl):
                    module._forward_impl = Fp8ForwardImpl(module._forward_impl, fp8, casts)
                    casts.routed += 1
                elif isinstance(module, GroupedMLP):  # ours (experts.NativeGroupedMLP) reads them in its GEMMs
                    module.fp8, module.fp8_casts = fp8, casts
                    casts.routed += 1
    return casts
