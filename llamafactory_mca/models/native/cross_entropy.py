"""Cross-entropy over the (vocab-parallel) logits without an fp32 copy of them.

Megatron's ``vocab_parallel_cross_entropy`` upcasts the bf16 logits to fp32 and keeps ``exp(logits)`` in fp32 for
the backward: at a 151,936-token vocabulary and 4,096 tokens that is 2.5 GB written, read back several times and
held until the backward (perf-notes: 13.9 ms per micro-batch, more than attention). The same loss needs only two
numbers per token, the row's max and its sum of ``exp(logit - max)``, and the backward only ``softmax - onehot``,
which can be recomputed from the bf16 logits. On GPUs both are one Triton pass each (``loss_triton.py``: read bf16
once; write the bf16 gradient once); elsewhere the same math runs eagerly over row chunks. Soft-capped logits
(Gemma's ``final_logit_softcapping``) come raw and are capped inside both passes, in fp32: the capped copy and
tanh's output would each be as big as the logits, and the loss could not run in chunks without them.

Tensor parallelism: each rank holds a vocabulary slice; per-row (max, sum) pairs are combined across ranks with
one MAX and one SUM all-reduce, the target's logit with a SUM, as in Megatron's. Labels outside the slice (other
ranks' tokens, and -100 padding) count as misses, exactly as Megatron's function treats them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from . import loss_triton
from .embedding import RowGradEmbedding, mark_output_use
from .logit_chunks import CHUNK_ROWS, chunks_logits, native_loss
from .per_layer_inputs import PerLayerInput, PerLayerInputs
from .wgrad import placeholder_grad, wgrad_gemm_accum_fp32


_EAGER_ROWS = 1024  # rows per chunk off GPUs: bounds the fp32 temporary at rows x vocab


def _capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The logits in fp32 as the loss sees them: ``cap * tanh(logit / cap)`` given a cap (-inf padding stays)."""
    x = logits.float()
    return x if not cap else torch.where(x == float("-inf"), x, torch.tanh(x / cap) * cap)


def _row_stats(logits: torch.Tensor, cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: max and sum of exp(logit - max), in fp32."""
    x = _capped(logits, cap)
    row_max = x.amax(-1)
    return row_max, (x - row_max.unsqueeze(-1)).exp().sum(-1)


def _grad(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, target: torch.Tensor,
          cap: float | None = None) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot(target)) * grad, computed in fp32, returned in the logits' dtype (by the
    raw logits: times tanh's slope 1 - (capped / cap)^2, given a cap)."""
    x = _capped(logits, cap)
    hit = torch.arange(logits.size(-1), device=logits.device) == target.unsqueeze(-1)
    out = ((x - lse.unsqueeze(-1)).exp() - hit.float()) * grad.unsqueeze(-1)
    if cap:
        out *= 1 - (torch.where(x == float("-inf"), 0.0, x) / cap) ** 2
    return out.to(logits.dtype)


def _kernels(device: torch.device) -> tuple:
    if device.type == "cuda":
        return loss_triton.row_stats, loss_triton.grad
    return _row_stats, _grad


def _rows(n: int, device: torch.device):
    """Row ranges to process at once: all of them in Triton, chunks eagerly."""
    step = n if device.type == "cuda" else _EAGER_ROWS
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def _local_targets(target: torch.Tensor, vocab: int, valid: int, group) -> tuple[torch.Tensor, int]:
    """Targets as columns of this rank's vocabulary slice (``vocab`` wide, its first ``valid`` real), -1 where the
    slice does not hold them (other ranks' tokens, -100 padding); and the TP world size."""
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    local = target - (dist.get_rank(group) if world > 1 else 0) * vocab
    return torch.where((local >= 0) & (local < valid), local, -1), world


def _combine(row_max: torch.Tensor, sum_exp: torch.Tensor, hit: torch.Tensor, local: torch.Tensor, world: int,
             group) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp from each rank's (max, sum of exp, target logit): one MAX and two SUM
    all-reduces under TP, as in Megatron's."""
    if world > 1:
        # a rank whose slice is all vocabulary padding (logits -inf: a vocabulary under tp x 128 / 2, as in tiny
        # test models) adds nothing to the sum; its exp(-inf - -inf) would be NaN
        sum_exp = torch.where(row_max == float("-inf"), 0.0, sum_exp)
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        sum_exp.mul_((row_max - global_max).exp())
        row_max = global_max
        dist.all_reduce(sum_exp, group=group)
    # the target's logit relative to the row max; 0 where no rank holds the target (-100), as in Megatron's
    predicted = torch.where(local >= 0, hit - row_max, 0.0)
    if world > 1:
        dist.all_reduce(predicted, group=group)
    log_sum = sum_exp.log()
    return log_sum - predicted, log_sum + row_max


def _target_logits(logits: torch.Tensor, local: torch.Tensor, cap: float | None) -> torch.Tensor:
    return _capped(logits.gather(-1, local.clamp(min=0).unsqueeze(-1)).squeeze(-1), cap)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, cap: float | None) -> torch.Tensor:
        shape = target.shape
        logits2d, target = logits.reshape(-1, logits.size(-1)), target.reshape(-1)
        local, world = _local_targets(target, logits2d.size(-1), logits2d.size(-1), group)
        stats, _ = _kernels(logits.device)
        row_max = torch.empty(target.numel(), dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(row_max)
        for a, b in _rows(target.numel(), logits.device):
            row_max[a:b], sum_exp[a:b] = stats(logits2d[a:b], cap)
        loss, lse = _combine(row_max, sum_exp, _target_logits(logits2d, local, cap), local, world, group)
        ctx.save_for_backward(logits, lse, local)
        ctx.cap = cap
        return loss.reshape(shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, lse, local = ctx.saved_tensors
        logits2d = logits.reshape(-1, logits.size(-1))
        grad_loss = grad_loss.reshape(-1).float()
        _, grad = _kernels(logits.device)
        # one piece in Triton, kept as it comes (copied into a buffer, it cost a logits-sized copy each backward)
        pieces = [grad(logits2d[a:b], lse[a:b], grad_loss[a:b], local[a:b], ctx.cap)
                  for a, b in _rows(local.numel(), logits.device)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out.view_as(logits), None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``hidden @ weight[:valid].T`` against global ``target`` ids, a chunk of rows at a time:
    forward keeps (max, sum of exp) per row; backward recomputes each chunk's logits, turns them into
    ``softmax - onehot`` and multiplies out the input and weight gradients. The weight's gradient goes into DDP's
    fp32 ``main_grad`` directly where the config fuses gradient accumulation, as Megatron's linear does."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, valid: int, group,
                fuse_wgrad: bool, cap: float | None) -> torch.Tensor:
        local, world = _local_targets(target, weight.size(0), valid, group)
        rows = hidden.size(0)
        row_max = torch.full((rows,), float("-inf"), dtype=torch.float32, device=hidden.device)
        sum_exp, hit = torch.zeros_like(row_max), torch.zeros_like(row_max)
        stats, _ = _kernels(hidden.device)
        for a, b in _chunks(rows, valid):
            logits = hidden[a:b] @ weight[:valid].t()
            row_max[a:b], sum_exp[a:b] = stats(logits, cap)
            hit[a:b] = _target_logits(logits, local[a:b], cap)
        loss, lse = _combine(row_max, sum_exp, hit, local, world, group)
        ctx.save_for_backward(hidden, weight, lse, local)
        ctx.valid, ctx.fuse_wgrad, ctx.cap = valid, fuse_wgrad, cap
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, lse, local = ctx.saved_tensors
        valid, grad_loss = ctx.valid, grad_loss.float()
        into_main = ctx.fuse_wgrad and hasattr(weight, "main_grad")
        d_hidden = torch.zeros_like(hidden)
        d_weight = None if into_main else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        _, grad = _kernels(hidden.device)
        for a, b in _chunks(hidden.size(0), valid):
            g = grad(hidden[a:b] @ weight[:valid].t(), lse[a:b], grad_loss[a:b], local[a:b], ctx.cap)
            d_hidden[a:b] = g @ weight[:valid]
            if into_main:
                wgrad_gemm_accum_fp32(hidden[a:b], g, weight.main_grad[:valid])
            else:
                d_weight[:valid] += (g.t() @ hidden[a:b]).float()
        d_weight = placeholder_grad(weight, hidden.dtype) if into_main else d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None


def _chunks(rows: int, valid: int):
    if not valid:  # a slice of vocabulary padding alone: nothing to compute
        return []
    return [(i, min(i + CHUNK_ROWS, rows)) for i in range(0, rows, CHUNK_ROWS)]


class DeferredLogits:
    """What the output layer hands the loss when the two are fused: the (gathered) input and the weight. Its
    ``valid`` columns are the real vocabulary of this rank's slice (models/auto.py masks the padding)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        self.hidden, self.weight, self.valid = hidden, weight, weight.size(0)


class FusedLossOutputLayer(ColumnParallelLinear):
    """Megatron's output layer, which computes the positions of ``rows`` alone where it is set (those whose target
    counts: ``LanguageModel._postprocess``), and hands the loss its input instead of the logits while ``defer`` is
    set (a training forward that chunks its logits)."""

    defer = False
    loss_caps = False  # the loss caps soft-capped logits itself (``_softcap``)
    rows: torch.Tensor | None = None  # [n] positions of the [s, b] input, flattened, on the input's device

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        mark_output_use(weight)  # a tied table's lookup leaves it the gradient
        if not (self.defer or self.rows is not None):
            return super().forward(input_, weight, runtime_gather_output)
        if self.sequence_parallel:  # the whole sequence on each rank, its gradient reduce-scattered back
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                          group=self.tp_group)
        else:  # each rank's input gradient covers its vocabulary slice: summed over TP in the backward
            input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        if self.rows is not None:
            input_ = input_.flatten(0, 1).index_select(0, self.rows).unsqueeze(1)  # [n, 1, h]
        if self.defer:
            return DeferredLogits(input_, weight), None
        # Megatron's linear on an input already gathered (or marked for the gradient's sum) as its own would be
        return self._forward_impl(input=input_, weight=weight, bias=None,
                                  gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                  allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                                  wgrad_deferral_limit=None, tp_group=self.tp_group), None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 cap: float | None = None) -> torch.Tensor:
    """Per-token loss (fp32, ``target``'s shape) of ``logits`` ``[..., vocab / tp]`` against global ``target`` ids;
    Megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` in value, without its fp32 copy of the logits (of
    ``cap * tanh(logits / cap)``, given a cap)."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, cap)


class NativeCrossEntropy:
    """Mixin for GPTModel: its language-model loss through ``vocab_parallel_cross_entropy`` above.

    Megatron's own path stays where asked for: ``native_cross_entropy: false`` in the recipe, or Megatron's
    ``cross_entropy_loss_fusion`` (its TE or native fused kernels)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor | DeferredLogits
                                    ) -> torch.Tensor:
        if not native_loss(self.config):
            return super().compute_language_model_loss(labels, logits)
        # raw logits (the output layer's ``loss_caps`` was set: ``_postprocess``), capped here where the model caps
        cap = getattr(self.config, "final_logit_softcapping", None)
        # labels [b, s]; logits (or the output layer's input) [s, b, ...] flattened sequence-major, or the output
        # layer's ``rows`` of them alone; the loss comes back [b, s] as Megatron's does, 0 where no row was computed
        target = labels.transpose(0, 1).reshape(-1)
        rows = self.output_layer.rows if self.post_process else None
        if rows is not None:
            target = target.index_select(0, rows)
        if isinstance(logits, DeferredLogits):
            hidden = logits.hidden.flatten(0, 1)
            loss = _LinearCrossEntropy.apply(hidden, logits.weight, target, logits.valid, self.pg_collection.tp,
                                             self.config.gradient_accumulation_fusion, cap)
        else:
            loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), target, self.pg_collection.tp, cap)
        if rows is not None:
            loss = loss.new_zeros(labels.numel()).index_copy(0, rows, loss)
        return loss.view(labels.size(1), labels.size(0)).transpose(0, 1).contiguous()

    def _chunks_logits(self, hidden_states: torch.Tensor) -> bool:
        """A training forward's loss through the output layer a chunk at a time (``chunked_cross_entropy``)."""
        # a stage before the last has no output layer (its _postprocess hands the hidden states on)
        if not isinstance(getattr(self, "output_layer", None), FusedLossOutputLayer) or not native_loss(self.config):
            return False
        tokens = hidden_states.shape[0] * hidden_states.shape[1] * (
            self.pg_collection.tp.size() if self.output_layer.sequence_parallel else 1)
        return chunks_logits(tokens, self.output_layer.output_size_per_partition,
                             getattr(self.config, "chunked_cross_entropy", None))


def _untrained_lookups(pad: int, module: Any, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The word embeddings' output where the input is ``pad``, without gradient: transformers builds its embeddings
    with ``padding_idx=pad_token_id``, whose row lookups never train (a tied output layer still does). It matters where
    the pad id stands inside a sequence (a tokenizer whose pad is its end-of-turn token, or an unknown word): a zero
    pad row, as checkpoints keep it, would take a gradient through the first norm scaled by 1 / sqrt(eps)."""
    mask = inputs[0] == pad  # [b, s]
    if module.reduce_scatter_embeddings:  # the output is this rank's sequence-parallel slice, [s / tp, b, h]
        size = output.shape[0]
        mask = mask.t()[module.tp_group.rank() * size:(module.tp_group.rank() + 1) * size]
    return torch.where(mask.unsqueeze(-1), output.detach(), output)


def _times_layer_scalar(layer: Any, inputs: tuple, output: Any) -> Any:
    if isinstance(output, tuple):
        return (output[0] * layer.layer_scalar, *output[1:])
    return output * layer.layer_scalar


def _softcap(cap: float, module: Any, inputs: tuple, output: Any) -> Any:
    if getattr(module, "loss_caps", False):  # the native loss caps them itself
        return output
    logits, *rest = output
    return (torch.tanh(logits / cap) * cap, *rest)


def proportional_inv_freq(head_dim: int, base: float, fraction: float, device: Any = None) -> torch.Tensor:
    """transformers' proportional RoPE (Gemma 4's full-attention layers): the frequencies of plain RoPE over the
    whole ``head_dim`` for the first ``fraction`` of each half, zero (no rotation) for the rest."""
    angles = int(fraction * head_dim // 2)
    rotated = 1.0 / base ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32, device=device) / head_dim)
    return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)])


class LanguageModel(NativeCrossEntropy, GPTModel):
    """Megatron's GPTModel with the loss above (parameters and checkpoint keys are GPTModel's).

    Asked for logits (no labels), a model with multi-token-prediction layers skips them: megatron-core 0.16.1 runs
    them regardless and then fails cloning the missing labels for their loss.

    Architecture fields of ours (``config.MODEL_OPTIONS``): ``embedding_multiplier`` scales the word embeddings
    (Gemma: sqrt(hidden), rounded to the activations' dtype as transformers does), on the embedding's output, so a
    vision-language model scales the text before image features replace placeholders; ``window_rotary_base`` gives
    the windowed layers their own RoPE table, ``global_attention`` the full-attention layers theirs (Gemma 4: wider
    heads, proportional RoPE), laid beside the model's (``native/sublayers.py`` picks); ``padding_idx`` is a row the
    lookups do not train, as in transformers; ``layer_scalars``: each decoder layer's output times its stored
    ``layer_scalar`` (Gemma 4; frozen, as transformers keeps it a buffer); ``final_logit_softcapping``: the logits
    through cap · tanh(logits / cap), by the native loss inside its passes (a training forward hands it the raw
    logits, ``_postprocess``), else by a hook on the output layer;
    ``per_layer_inputs``: each layer's own vector per token, made from the decoder's input and handed to the layers
    as their ``context`` (``native/per_layer_inputs.py``); ``kv_sharing``: the last layers attend with the keys and
    values of an earlier layer, kept for them while the forward runs (``native/sublayers.py``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.post_process and type(self.output_layer) is ColumnParallelLinear:
            self.output_layer.__class__ = FusedLossOutputLayer  # behaviour only: the same module, parameters, keys
        if self.pre_process and type(self.embedding.word_embeddings) is VocabParallelEmbedding:
            self.embedding.word_embeddings.__class__ = RowGradEmbedding  # the same: its gradient rows into main_grad
            RowGradEmbedding.own_rows_only(self.embedding.word_embeddings)
        multiplier = getattr(self.config, "embedding_multiplier", None)
        if multiplier and self.pre_process:
            self.embedding.register_forward_hook(
                lambda module, inputs, output: output * torch.tensor(multiplier, dtype=output.dtype))
        pad = getattr(self.config, "padding_idx", None)
        if pad is not None and self.pre_process:
            self.embedding.word_embeddings.register_forward_hook(partial(_untrained_lookups, pad))
        self.other_rotary_pos_emb = self._other_rope(kwargs.get("rotary_percent", 1.0))
        self.per_layer_inputs = None
        self._loss_rows: torch.Tensor | None = None  # while a forward runs: its ``loss_rows``
        if (getattr(self.config, "per_layer_inputs", None) or getattr(self.config, "kv_sharing", None)) and not (
                self.pre_process and self.post_process):  # refused before any worker starts: parallel.check_layout
            raise ValueError("per-layer inputs and shared keys and values need the whole model on one pipeline stage")
        if getattr(self.config, "per_layer_inputs", None):  # each layer's part runs before its scalar (below)
            tp_group = self.pg_collection.tp
            if self.pre_process:
                self.per_layer_inputs = PerLayerInputs(self.config, tp_group, pad)
            for layer in self.decoder.layers:
                PerLayerInput.attach(layer, tp_group)
        # the keys and values of the layers whose later layers attend with them, while a forward runs
        self.shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if getattr(self.config, "kv_sharing", None):
            for layer in self.decoder.layers:
                layer.self_attention.shared_kv = self.shared_kv
        if getattr(self.config, "layer_scalars", False):
            for layer in self.decoder.layers:
                layer.layer_scalar = torch.nn.Parameter(torch.ones(1, dtype=self.config.params_dtype, device=(
                    "cpu" if self.config.use_cpu_initialization else torch.cuda.current_device())),
                    requires_grad=False)
                layer.layer_scalar.no_gradient = True  # freeze-tuning keeps it so in the layers it trains
                layer.register_forward_hook(_times_layer_scalar)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap and self.post_process:  # before models/auto.py's hook sets the padded vocabulary to -inf
            self.output_layer.register_forward_hook(partial(_softcap, float(cap)))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                decoder_input: torch.Tensor | None = None, *args: Any, loss_rows: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        """``loss_rows``: the positions whose target counts (``MicroBatch.loss_rows``), the only ones whose logits a
        training forward computes (``_postprocess``)."""
        self._loss_rows = loss_rows  # for _postprocess, which Megatron's forward calls with arguments of its own
        if self.per_layer_inputs is not None:
            if decoder_input is None:
                decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
            vectors = self.per_layer_inputs(self.per_layer_ids(input_ids), decoder_input)
            kwargs["extra_block_kwargs"] = {**(kwargs.get("extra_block_kwargs") or {}), "context": vectors}
        try:
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)
        finally:
            self.shared_kv.clear()
            self._loss_rows = None

    def per_layer_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids the per-layer embedding looks up (a vision-language model's image tokens: the padding id)."""
        return input_ids

    def _other_rope(self, rotary_percent: float) -> RotaryEmbedding | None:
        """The RoPE of the layers that do not rotate by the model's (``window_rotary_base``, ``global_attention``)."""
        window, full = getattr(self.config, "window_rotary_base", None), getattr(self.config, "global_attention", None)
        if not (window or full):
            return None
        if self.position_embedding_type != "rope" or rotary_percent != 1.0:  # the layers cut the tables by head dim
            raise ValueError(f"a RoPE per kind of layer with position_embedding_type={self.position_embedding_type!r}"
                             f", rotary_percent={rotary_percent}: built for plain RoPE on whole heads only.")
        rope = self.rotary_pos_emb
        other = RotaryEmbedding(
            kv_channels=full["kv_channels"] if full else self.config.kv_channels, rotary_percent=1.0,
            rotary_interleaved=self.config.rotary_interleaved, rotary_base=full["rotary_base"] if full else window,
            use_cpu_initialization=self.config.use_cpu_initialization, cp_group=rope.cp_group)
        if full:
            other.inv_freq = proportional_inv_freq(full["kv_channels"], full["rotary_base"], full["rope_fraction"],
                                                   other.inv_freq.device)
        return other

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, *args, **kwargs):
        out = super()._preprocess(input_ids, position_ids, decoder_input, inference_context, packed_seq_params,
                                  *args, **kwargs)
        if self.other_rotary_pos_emb is None or out[1] is None:
            return out
        length = self.rotary_pos_emb.get_rotary_seq_len(inference_context, self.decoder, out[0], self.config,
                                                        packed_seq_params)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        other = self.other_rotary_pos_emb(length, packed_seq=packed,
                                          cp_group=packed_seq_params.cp_group if packed_seq_params else None)
        return (out[0], torch.cat((out[1], other), dim=-1), *out[2:])

    def _postprocess(self, *args, **kwargs):
        if getattr(self, "value_head", None) is not None:  # a reward model (models/value_head.py): no logits
            return self.value_head(kwargs["hidden_states"])
        layers = self.config.mtp_num_layers
        if kwargs.get("labels") is not None and native_loss(self.config) and self.post_process:
            # the loss takes the logits raw (it caps soft-capped ones itself), or the output layer's input where it
            # chunks them; the MTP layers' losses too
            self.output_layer.loss_caps = True
            self.output_layer.defer = self._chunks_logits(kwargs["hidden_states"])
            # the positions whose target counts alone (the rest would be multiplied by a zero loss mask); not with
            # MTP, whose layers' logits go through the same output layer for targets of their own
            if isinstance(self.output_layer, FusedLossOutputLayer) and not layers and \
                    not self.output_layer.gather_output:
                self.output_layer.rows = self._loss_rows
            try:
                return super()._postprocess(*args, **kwargs)
            finally:
                self.output_layer.loss_caps = self.output_layer.defer = False
                self.output_layer.rows = None
        if not layers or kwargs.get("labels") is not None:
            return super()._postprocess(*args, **kwargs)
        self.config.mtp_num_layers = None  # the flag _postprocess reads; restored at once
        try:
            return super()._postprocess(*args, **{**kwargs, "mtp_in_postprocess": False})
        finally:
            self.config.mtp_num_layers = layers
