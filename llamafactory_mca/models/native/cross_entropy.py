"""Cross-entropy over the (vocab-parallel) logits without an fp32 copy of them.

Megatron's ``vocab_parallel_cross_entropy`` upcasts the bf16 logits to fp32 and keeps ``exp(logits)`` in fp32 for
the backward: at a 151,936-token vocabulary and 4,096 tokens that is 2.5 GB written, read back several times and
held until the backward (perf-notes: 13.9 ms per micro-batch, more than attention). The same loss needs only two
numbers per token, the row's max and its sum of ``exp(logit - max)``, and the backward only ``softmax - onehot``,
which can be recomputed from the bf16 logits. On GPUs both are compiled into one pass each (read bf16 once; write
the bf16 gradient once); elsewhere the same functions run eagerly over row chunks, so CPU runs test the same math.

Tensor parallelism: each rank holds a vocabulary slice; per-row (max, sum) pairs are combined across ranks with
one MAX and one SUM all-reduce, the target's logit with a SUM, as in Megatron's. Labels outside the slice (other
ranks' tokens, and -100 padding) count as misses, exactly as Megatron's function treats them.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel

_EAGER_ROWS = 1024  # rows per chunk when not compiled: bounds the fp32 temporary at rows x vocab


def _row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: max and sum of exp(logit - max), in fp32."""
    x = logits.float()
    row_max = x.amax(-1)
    return row_max, (x - row_max.unsqueeze(-1)).exp().sum(-1)


def _grad(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot(target)) * grad, computed in fp32, returned in the logits' dtype."""
    probs = (logits.float() - lse.unsqueeze(-1)).exp()
    hit = torch.arange(logits.size(-1), device=logits.device) == target.unsqueeze(-1)
    return ((probs - hit.float()) * grad.unsqueeze(-1)).to(logits.dtype)


@cache
def _compiled(name: str):
    # Automatic dynamic shapes: the first row count compiles static and a later different one makes only the rows
    # symbolic. The vocabulary stays a constant, so each element's column is a division by a constant; with
    # ``dynamic=True`` it was a division by a runtime value and both kernels ran at a fifth of the memory bandwidth.
    return torch.compile({"stats": _row_stats, "grad": _grad}[name], dynamic=None)


def _kernels(device: torch.device) -> tuple:
    if device.type == "cuda":
        return _compiled("stats"), _compiled("grad")
    return _row_stats, _grad


def _rows(n: int, device: torch.device):
    """Row ranges to process at once: all of them compiled, chunks eagerly."""
    step = n if device.type == "cuda" else _EAGER_ROWS
    return [(i, min(i + step, n)) for i in range(0, n, step)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        shape = target.shape
        logits2d, target = logits.reshape(-1, logits.size(-1)), target.reshape(-1)
        world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        vocab = logits2d.size(-1)
        start = (dist.get_rank(group) if world > 1 else 0) * vocab
        local = target - start
        local = torch.where((local >= 0) & (local < vocab), local, -1)
        stats, _ = _kernels(logits.device)
        row_max = torch.empty(target.numel(), dtype=torch.float32, device=logits.device)
        sum_exp = torch.empty_like(row_max)
        for a, b in _rows(target.numel(), logits.device):
            row_max[a:b], sum_exp[a:b] = stats(logits2d[a:b])
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
        hit = logits2d.gather(-1, local.clamp(min=0).unsqueeze(-1)).squeeze(-1).float() - row_max
        predicted = torch.where(local >= 0, hit, 0.0)
        if world > 1:
            dist.all_reduce(predicted, group=group)
        log_sum = sum_exp.log()
        lse = log_sum + row_max
        ctx.save_for_backward(logits, lse, local)
        return (log_sum - predicted).reshape(shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, lse, local = ctx.saved_tensors
        logits2d = logits.reshape(-1, logits.size(-1))
        grad_loss = grad_loss.reshape(-1).float()
        _, grad = _kernels(logits.device)
        out = torch.empty_like(logits2d)
        for a, b in _rows(local.numel(), logits.device):
            out[a:b] = grad(logits2d[a:b], lse[a:b], grad_loss[a:b], local[a:b])
        return out.view_as(logits), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss (fp32, ``target``'s shape) of ``logits`` ``[..., vocab / tp]`` against global ``target`` ids;
    Megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` in value, without its fp32 copy of the logits."""
    return _VocabParallelCrossEntropy.apply(logits, target, group)


class NativeCrossEntropy:
    """Mixin for GPTModel: its language-model loss through ``vocab_parallel_cross_entropy`` above.

    Megatron's own path stays where asked for: ``native_cross_entropy: false`` in the recipe, or Megatron's
    ``cross_entropy_loss_fusion`` (its TE or native fused kernels)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not getattr(self.config, "native_cross_entropy", True) or self.config.cross_entropy_loss_fusion:
            return super().compute_language_model_loss(labels, logits)
        # labels [b, s], logits [s, b, v]; the loss comes back [b, s] as Megatron's does
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()


class LanguageModel(NativeCrossEntropy, GPTModel):
    """Megatron's GPTModel with the loss above (parameters and checkpoint keys are GPTModel's).

    Asked for logits (no labels), a model with multi-token-prediction layers skips them: megatron-core 0.16.1 runs
    them regardless and then fails cloning the missing labels for their loss.

    Two architecture fields of ours (``config.MODEL_OPTIONS``): ``embedding_multiplier`` scales the word embeddings
    (Gemma: sqrt(hidden), rounded to the activations' dtype as transformers does), on the embedding's output, so a
    vision-language model scales the text before image features replace placeholders; ``window_rotary_base`` gives
    the windowed layers their own RoPE table, stacked after the model's (``native/sublayers.py`` picks)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        multiplier = getattr(self.config, "embedding_multiplier", None)
        if multiplier and self.pre_process:
            self.embedding.register_forward_hook(
                lambda module, inputs, output: output * torch.tensor(multiplier, dtype=output.dtype))
        base = getattr(self.config, "window_rotary_base", None)
        self.window_rotary_pos_emb = None
        if base and self.position_embedding_type != "rope":  # the layers would index a single table
            raise ValueError(f"window_rotary_base with position_embedding_type={self.position_embedding_type!r}: "
                             "a RoPE base per kind of layer is built for plain RoPE only.")
        if base:
            rope = self.rotary_pos_emb
            self.window_rotary_pos_emb = RotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
                rotary_interleaved=self.config.rotary_interleaved, rotary_base=base,
                use_cpu_initialization=self.config.use_cpu_initialization, cp_group=rope.cp_group)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, *args, **kwargs):
        out = super()._preprocess(input_ids, position_ids, decoder_input, inference_context, packed_seq_params,
                                  *args, **kwargs)
        if self.window_rotary_pos_emb is None or out[1] is None:
            return out
        length = self.rotary_pos_emb.get_rotary_seq_len(inference_context, self.decoder, out[0], self.config,
                                                        packed_seq_params)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        window = self.window_rotary_pos_emb(length, packed_seq=packed,
                                            cp_group=packed_seq_params.cp_group if packed_seq_params else None)
        return (out[0], torch.stack((out[1], window)), *out[2:])

    def _postprocess(self, *args, **kwargs):
        layers = self.config.mtp_num_layers
        if not layers or kwargs.get("labels") is not None:
            return super()._postprocess(*args, **kwargs)
        self.config.mtp_num_layers = None  # the flag _postprocess reads; restored at once
        try:
            return super()._postprocess(*args, **{**kwargs, "mtp_in_postprocess": False})
        finally:
            self.config.mtp_num_layers = layers
