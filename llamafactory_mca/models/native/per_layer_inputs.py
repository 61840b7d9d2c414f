"""Gemma 4's per-layer inputs (the E2B/E4B's ``hidden_size_per_layer_input``): every decoder layer gets, beside the
residual stream, a small vector of its own for each token, and mixes it in after its MLP.

The vectors are made once, from the decoder's input (``PerLayerInputs``): a second embedding of the token ids, of
width layers x d, plus a projection of the input embeddings normalised per layer, the two averaged. In a vision-
language model the projection sees the images' features and the ids of an image's tokens are the padding id, as
transformers has it. They reach the layers as the decoder's ``context``, which Megatron's TransformerBlock hands to
every layer and to activation recomputation (as Qwen3-VL's deepstack features go); each layer's forward hook adds
``gate -> GELU x its vector -> projection -> norm`` to its output (``PerLayerInput``), before the layer's scalar.

Tensor parallelism splits d, as it splits an MLP's width: the layer's gate is column-parallel, its projection
row-parallel, and each rank keeps its d / tp of every vector. The vectors are made whole on every rank from the
whole sequence (the embedding and the norm replicated, the model's projection column-parallel and gathered), so
every rank's gradients of them are the whole ones. The pipeline does not carry them between stages: a model with them
trains on one stage (``parallel.check_layout``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.module import MegatronModule

from .embedding import lookup
from .norm import NativeNorm
from .swiglu_triton import gelu_times


def _device(config: Any) -> Any:
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


class PerLayerInputs(MegatronModule):
    """The vectors of every layer, [layers, s, b, d / tp], from the token ids [b, s] and the decoder's input
    [s (/ tp under sequence parallelism), b, hidden]."""

    def __init__(self, config: Any, tp_group: Any, padding_idx: int | None) -> None:
        super().__init__(config)
        spec = config.per_layer_inputs
        self.layers, self.width = config.num_layers, spec["width"]
        whole = self.layers * self.width
        self.embedding = torch.nn.Embedding(spec["vocab"], whole, padding_idx=padding_idx, device=_device(config),
                                            dtype=config.params_dtype)
        config.init_method(self.embedding.weight)
        # its input is the whole sequence on every rank, and its output gathered: no sequence parallelism inside
        self.linear_proj = ColumnParallelLinear(
            config.hidden_size, whole, config=dataclasses.replace(config, sequence_parallel=False),
            init_method=config.init_method, bias=False, gather_output=False, tp_group=tp_group)
        self.norm = NativeNorm(config, self.width, eps=config.layernorm_epsilon, mark_sequence_parallel=False)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.sequence_parallel:  # every rank's gradient of the whole sequence is the whole one: split it
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        s, b = hidden.shape[:2]
        projected, _ = self.linear_proj(hidden)
        projected = gather_from_tensor_model_parallel_region(projected) * self.config.hidden_size ** -0.5
        projected = self.norm(projected.view(s, b, self.layers, self.width))
        scale = torch.tensor(self.width ** 0.5, dtype=self.embedding.weight.dtype)
        tokens = lookup(input_ids.t(), self.embedding.weight, self.embedding.padding_idx) * scale
        tokens = tokens.view(s, b, self.layers, self.width)
        vectors = scatter_to_tensor_model_parallel_region((projected + tokens) * 2 ** -0.5)
        return vectors.permute(2, 0, 1, 3)


class PerLayerInput(MegatronModule):
    """One layer's part: its output plus norm(projection(GELU(gate(output)) x its vector))."""

    def __init__(self, config: Any, tp_group: Any) -> None:
        super().__init__(config)
        width = config.per_layer_inputs["width"]
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, width, config=config,
                                               init_method=config.init_method, bias=False, gather_output=False,
                                               tp_group=tp_group)
        self.linear_fc2 = RowParallelLinear(width, config.hidden_size, config=config,
                                            init_method=config.output_layer_init_method, bias=False,
                                            input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)
        self.post_norm = NativeNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
        gate, _ = self.linear_fc1(hidden)
        if gate.is_cuda:  # one Triton kernel each way (eager torch: two forward, three backward)
            gated = gelu_times(gate, vector)
        else:
            gated = torch.nn.functional.gelu(gate, approximate="tanh") * vector
        mixed, _ = self.linear_fc2(gated)
        return hidden + self.post_norm(mixed)

    @classmethod
    def attach(cls, layer: torch.nn.Module, tp_group: Any) -> None:
        """Give a decoder layer its part, run after the layer (before hooks registered later: the layer scalar)."""
        layer.per_layer_input = cls(layer.config, tp_group)
        layer.register_forward_hook(_add_per_layer_input, with_kwargs=True)


def _add_per_layer_input(layer: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    hidden, context = output
    return layer.per_layer_input(hidden, kwargs["context"][layer.layer_number - 1]), context
