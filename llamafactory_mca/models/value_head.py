"""The reward model's value head (``stage: rm``): trl's ``ValueHead`` on the last pipeline stage, and its file.

LLaMA-Factory's rm stage wraps the causal LM in trl's ``AutoModelForCausalLMWithValueHead``: dropout
(``summary_dropout_prob`` from the model's config, else 0.1) and ``Linear(hidden, 1)`` over the last hidden states
(after the final norm); the LM head is not used. Here the same two modules sit on the last stage's chunk as
``value_head``, replicated on its tensor-parallel ranks (one output column: nothing to split). Its input is the whole
sequence on every TP rank (gathered under sequence parallelism, the gradient scattered back), and its dropout draws
from the default generator, which ``parallel.initialize`` seeds alike on those ranks, so the copies stay equal.

Files: LLaMA-Factory reads ``value_head.safetensors`` from ``model_name_or_path`` (or the last adapter) with trl's
keys ``v_head.summary.weight`` / ``.bias`` and writes the same file beside the exported weights
(``fix_valuehead_checkpoint``); a head without one starts as trl's does (``nn.Linear``'s own initialisation, here
from the run's seed). In our checkpoints it is a plain module of the chunk, so Megatron's sharded state dict holds
it under ``value_head.summary.*`` and resume, merge and convert carry it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from llamafactory.extras.constants import V_HEAD_SAFE_WEIGHTS_NAME
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from safetensors.torch import load_file, save_file


PREFIX = "value_head."  # the chunk's module name: its keys in our checkpoints
TRL_PREFIX = "v_head."  # trl's, in value_head.safetensors
WEIGHT_KEY = f"{PREFIX}summary.weight"


class ValueHead(torch.nn.Module):
    """trl's ValueHead over Megatron's ``[s, b, h]`` hidden states; returns fp32 values ``[b, s]``."""

    def __init__(self, hidden_size: int, dropout: float, dtype: torch.dtype, seed: int, config: Any) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        with torch.random.fork_rng(devices=[]):  # every rank the same head, the run's other draws untouched
            torch.manual_seed(seed)
            self.summary = torch.nn.Linear(hidden_size, 1, dtype=dtype)
        self.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        values = self.summary(self.dropout(hidden).to(self.summary.weight.dtype))
        return values.squeeze(-1).transpose(0, 1).float()


def attach(chunks: list[torch.nn.Module], hf_config: dict, transformer_config: Any, seed: int) -> None:
    """A value head on the chunk that holds the end of the model (the last pipeline stage's last virtual chunk)."""
    dropout = hf_config.get("summary_dropout_prob", 0.1)  # trl reads the model config's, else 0.1
    for chunk in chunks:
        if chunk.post_process:
            chunk.value_head = ValueHead(transformer_config.hidden_size, dropout, transformer_config.params_dtype,
                                         seed, transformer_config)
            if torch.cuda.is_available():
                chunk.value_head.cuda()
            # the LM head is not used: no logits, and an untied output layer stays as loaded (as trl's lm_head, which
            # gets no gradient). A tied one on a later stage keeps training: its gradient is summed with the
            # embedding's on the first stage, which must find it.
            weight = getattr(getattr(chunk, "output_layer", None), "weight", None)
            if weight is not None and not chunk.share_embeddings_and_output_weights:
                weight.requires_grad_(False)


def heads(chunks: list[torch.nn.Module]) -> list[ValueHead]:
    return [chunk.value_head for chunk in chunks if getattr(chunk, "value_head", None) is not None]


def train_whole(chunks: list[torch.nn.Module], adapters: tuple[str, ...] = ()) -> None:
    """After the finetuning setup: the head trains whole in every finetuning type, as in LLaMA-Factory (trl's head
    sits outside the peft model and the frozen layers); a LoRA run continuing an adapter takes the head saved beside
    it, as LLaMA-Factory reads it from the last ``adapter_name_or_path``."""
    if adapters:
        load_file_into(chunks, adapters[-1])
    for head in heads(chunks):
        head.requires_grad_(True)


def read_file(folder: str) -> dict[str, torch.Tensor] | None:
    """``folder``'s value_head.safetensors as our keys, or None without one."""
    path = os.path.join(folder, V_HEAD_SAFE_WEIGHTS_NAME)
    if not os.path.isfile(path):
        return None
    return {PREFIX + key[len(TRL_PREFIX):]: tensor for key, tensor in load_file(path).items()
            if key.startswith(TRL_PREFIX)}


def load_file_into(chunks: list[torch.nn.Module], folder: str) -> bool:
    """Load ``folder``'s value_head.safetensors into the head, if both exist."""
    found = read_file(folder)
    if found is None:
        return False
    for head in heads(chunks):
        with torch.no_grad():
            for name, param in head.named_parameters():
                param.copy_(found[PREFIX + name].reshape(param.shape))
    return True


def write_file(reader: Any, folder: str, dtype: torch.dtype | None = None) -> bool:
    """value_head.safetensors with trl's keys into ``folder`` when the checkpoint (a ``DistCheckpointReader``) holds a
    head: LLaMA-Factory's ``fix_valuehead_checkpoint`` output."""
    if WEIGHT_KEY not in reader:
        return False
    tensors = {}
    for name in ("weight", "bias"):
        tensor = reader.read(f"{PREFIX}summary.{name}")
        tensors[f"{TRL_PREFIX}summary.{name}"] = (tensor if dtype is None else tensor.to(dtype)).contiguous()
    save_file(tensors, os.path.join(folder, V_HEAD_SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    return True
