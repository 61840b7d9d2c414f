"""The two argument classes LLaMA-Factory parses under ``USE_MCA=1`` (``mcore_adapter.TrainingArguments``).

They mix our keys (``args.py``) into Hugging Face's ``TrainingArguments``: our checks run first, before any
process group exists, then Hugging Face's. Kept apart from ``args.py`` because importing transformers'
argument classes takes seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers

from .args import MegatronArguments, _HostCompatArguments
from .cpu_mode import cpu_mode_needed
from .errors import UserError
from .parallel import ParallelLayout


class _McaTrainingMixin:
    """The shared ``__post_init__``: our checks first (no process group yet), then Hugging Face's."""

    def _mca_post_init(self, hf_cls: type) -> None:
        MegatronArguments.__post_init__(self)
        if self.deepspeed:
            raise UserError(
                f"deepspeed={self.deepspeed!r} cannot be combined with USE_MCA=1: Megatron-Core does the sharding "
                "itself. Remove the deepspeed key (use use_distributed_optimizer: true for ZeRO-1-like sharding)."
            )
        if self.bf16 and self.fp16:
            raise UserError("bf16=True and fp16=True: choose one precision.")
        self._check_training_keys()
        if self.store_param_remainders and not self.bf16:
            raise UserError("store_param_remainders=True keeps fp32 master weights as remainders of bf16 weights, "
                            f"and this run is not bf16 (bf16={self.bf16}, fp16={self.fp16}). Set bf16: true, or drop "
                            "store_param_remainders.")
        if self.bf16 and not self.accumulate_allreduce_grads_in_fp32:
            self.accumulate_allreduce_grads_in_fp32 = True

        if cpu_mode_needed():
            self.use_cpu = True  # no GPU: gloo, and Hugging Face's bf16-needs-a-GPU check stays quiet
        hf_cls.__post_init__(self)

    def _check_training_keys(self) -> None:
        """Hugging Face's keys that would otherwise fail inside the workers (a traceback per rank) or train nothing."""
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)!r} must be a positive integer.")
        if self.learning_rate < 0:
            raise UserError(f"learning_rate={self.learning_rate} must not be negative.")
        if str(getattr(self.save_strategy, "value", self.save_strategy)) == "steps" and self.save_steps <= 0:
            raise UserError(f"save_strategy=steps with save_steps={self.save_steps}: give a positive save_steps "
                            "(or save_strategy: no).")
        if self.do_train and self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise UserError(f"max_steps={self.max_steps} and num_train_epochs={self.num_train_epochs}: nothing to "
                            "train. Set num_train_epochs (or max_steps) to a positive number.")

    def resolve_layout(self, world_size: int | None = None, seq_length: int | None = None):
        """The second check, once the world size is known: see ``parallel.ParallelLayout``."""
        return ParallelLayout.from_args(self, world_size=world_size, seq_length=seq_length)


@dataclass
class TrainingArguments(_McaTrainingMixin, MegatronArguments, _HostCompatArguments, transformers.TrainingArguments):
    def __post_init__(self) -> None:
        self._mca_post_init(transformers.TrainingArguments)


@dataclass
class Seq2SeqTrainingArguments(
    _McaTrainingMixin, MegatronArguments, _HostCompatArguments, transformers.Seq2SeqTrainingArguments
):
    def __post_init__(self) -> None:
        self._mca_post_init(transformers.Seq2SeqTrainingArguments)


