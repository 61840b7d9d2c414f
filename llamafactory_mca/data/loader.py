"""The data plan: deterministic, DP-sharded, resumable micro-batches from a tokenized dataset.

The plan is built from row lengths only (one Arrow scan), so every rank can afford it: it answers how
many micro-batches and steps an epoch has. Only ranks that feed the model (first and last pipeline
stage; the trainer decides) create an iterator, which reads rows lazily, one micro-batch at a time.

The stream is global and independent of the data-parallel size: epoch after epoch, global micro-batch
``g`` goes to rank ``g % dp``. A run resumed with ``consumed`` micro-batches (steps × dp × grad_accum)
continues the same stream, even onto a different dp (only where an epoch's tail is cut can depend on dp).

Epochs: padded micro-batches are cut from the rows shuffled with (seed, epoch). Packs are built once,
from the rows shuffled with the seed, and each epoch shuffles the packs with (seed, epoch): so every
epoch has the same number of micro-batches (the trainer's steps per epoch, learning-rate schedule and
resume arithmetic stay exact and O(1)), while sequences in a pack never see each other (THD), so which
rows share a pack changes only how the loss of a micro-batch is normalised, not what is learned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .batch import MicroBatch
from .packing import (
    chunk,
    collate_packed,
    collate_padded,
    pack_window_ffd,
    padded_multiple,
    round_up,
    round_up_array,
)
from .rows import PAIRWISE, RowTable, columns_for, detect_kind, fetch_samples, scan_rows

if TYPE_CHECKING:
    from datasets import Dataset


logger = logging.getLogger(__name__)

TAILS = ("keep", "drop", "pad")
_PACK_STREAM, _EPOCH_STREAM = 0, 1  # separate random streams: the packing order and each epoch's shuffle


@dataclass(frozen=True)
class BatchingConfig:
    """How rows become micro-batches.

    ``cutoff_len`` is the user's value: positions per row (the workflow tokenizes ``cutoff_len + 1``
    tokens so that the in-sequence shift loses nothing). ``micro_batch_size`` is
    ``per_device_train_batch_size``, in pairs for DPO. A pack holds at most
    ``capacity = round_up(cutoff_len, pad_multiple) × micro_batch_size`` tokens (× 2 for DPO pairs): the
    same token budget as a padded micro-batch of full rows, so memory planning does not change with packing.
    """

    cutoff_len: int
    micro_batch_size: int = 1
    packing: bool = False
    pad_multiple: int = 1
    variable_seq_lengths: bool = True  # False: one length for every micro-batch (MoE allgather dispatcher)
    pack_window: int = 128  # rows per first-fit-decreasing window
    pad_token_id: int = 0
    seed: int = 42
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name in ("cutoff_len", "micro_batch_size", "pad_multiple", "pack_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")

    @classmethod
    def from_args(cls, args: Any, *, cutoff_len: int, packing: bool, pad_multiple: int, pad_token_id: int,
                  for_eval: bool = False) -> BatchingConfig:
        """From our TrainingArguments. ``cutoff_len`` and ``packing`` come from the workflow, because
        LLaMA-Factory's ``DataArguments`` lowers ``cutoff_len`` by one when its own packing is on."""
        micro = args.per_device_eval_batch_size if for_eval else args.per_device_train_batch_size
        seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
        return cls(cutoff_len=cutoff_len, micro_batch_size=micro, packing=packing, pad_multiple=pad_multiple,
                   variable_seq_lengths=args.allow_variable_seq_lengths(), pad_token_id=pad_token_id, seed=seed,
                   shuffle=not for_eval)

    def capacity(self, sequences_per_row: int = 1) -> int:
        """Tokens per pack."""
        return round_up(self.cutoff_len, self.pad_multiple) * self.micro_batch_size * sequences_per_row

    @property
    def fixed_length(self) -> int:
        """Row length of every padded micro-batch when lengths may not vary."""
        return round_up(self.cutoff_len, padded_multiple(self.pad_multiple))


def _rng(seed: int, stream: int, epoch: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stream, epoch])


class DataPlan:
    """Which rows form which micro-batch, for every epoch; collation on demand."""

    def __init__(self, dataset: Dataset, config: BatchingConfig, log: bool = True) -> None:
        if not hasattr(dataset, "select_columns") or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"DataPlan needs a map-style datasets.Dataset, got {type(dataset).__name__}; streaming datasets "
                "cannot be planned, shuffled or resumed exactly. Set streaming: false."
            )
        self.config = config
        self.kind = detect_kind(dataset.column_names)
        self.table: RowTable = scan_rows(dataset, self.kind, config.cutoff_len)
        self._dataset = dataset.select_columns(columns_for(self.kind, dataset.column_names))
        self._kept = np.flatnonzero(self.table.keep)
        self._packs: list[tuple[int, ...]] | None = None
        if config.packing:
            sizes = round_up_array(self.table.lengths, config.pad_multiple).sum(axis=1)
            order = _rng(config.seed, _PACK_STREAM).permutation(self._kept) if config.shuffle else self._kept
            self._packs = pack_window_ffd(sizes, order, self.capacity, config.pack_window)
        self._epochs: dict[int, list[tuple[int, ...]]] = {}  # the last two epochs asked for
        self.stats = self._stats()
        if log:
            logger.info(format_stats(self.stats))

    @property
    def pairwise(self) -> bool:
        return self.kind == PAIRWISE

    @property
    def capacity(self) -> int:
        return self.config.capacity(self.table.sequences_per_row)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches in every epoch, before any tail is cut or padded."""
        if self._packs is not None:
            return len(self._packs)
        return -(-len(self._kept) // self.config.micro_batch_size)

    def micro_batches_per_epoch(self, multiple_of: int = 1, tail: str = "keep") -> int:
        """``drop`` cuts the ragged tail, ``pad`` fills it with loss-free stand-ins, to a multiple of ``multiple_of``
        (dp × grad_accum for training, so every step has exactly that many micro-batches)."""
        if tail not in TAILS:
            raise ValueError(f"tail={tail!r} is not one of {TAILS}.")
        count = self.num_micro_batches
        if tail == "drop":
            return count - count % multiple_of
        return round_up(count, multiple_of) if tail == "pad" else count

    def steps_per_epoch(self, dp_size: int, grad_accum: int) -> int:
        """Optimizer steps per epoch with the ragged tail dropped."""
        return self.num_micro_batches // (dp_size * grad_accum)

    def epoch_groups(self, epoch: int) -> list[tuple[int, ...]]:
        """The global micro-batches of ``epoch``, as row indices into the dataset."""
        if epoch not in self._epochs:
            shuffle = self.config.shuffle
            if self._packs is not None:
                order = _rng(self.config.seed, _EPOCH_STREAM, epoch).permutation(len(self._packs)) if shuffle else None
                groups = self._packs if order is None else [self._packs[i] for i in order]
            else:
                rows = _rng(self.config.seed, _EPOCH_STREAM, epoch).permutation(self._kept) if shuffle else self._kept
                groups = chunk(rows, self.config.micro_batch_size)
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = groups
        return self._epochs[epoch]

    def collate(self, group: tuple[int, ...]) -> MicroBatch:
        """Read the group's rows and lay them out (packed or padded, as configured)."""
        config = self.config
        samples = fetch_samples(self._dataset, list(group), self.kind, config.cutoff_len)
        if config.packing:
            total = None if config.variable_seq_lengths else self.capacity
            return collate_packed(samples, config.pad_multiple, config.pad_token_id, self.pairwise, total)
        fixed = None if config.variable_seq_lengths else config.fixed_length
        return collate_padded(samples, config.pad_multiple, config.pad_token_id, self.pairwise, fixed)

    def micro_batch(self, epoch: int, index: int) -> MicroBatch:
        """Micro-batch ``index`` of ``epoch``; past the real ones (``tail="pad"``), a loss-free copy of the first."""
        groups = self.epoch_groups(epoch)
        if index < len(groups):
            return self.collate(groups[index])
        return self.collate(groups[0]).without_loss()

    def iterator(self, dp_rank: int = 0, dp_size: int = 1, consumed: int = 0, multiple_of: int = 1,
                 tail: str = "keep", epochs: int | None = None) -> MicroBatchIterator:
        """This rank's micro-batches from global position ``consumed`` on; see ``MicroBatchIterator``."""
        return MicroBatchIterator(self, dp_rank, dp_size, consumed, multiple_of, tail, epochs)

    def _stats(self) -> dict[str, Any]:
        table, config = self.table, self.config
        kept_lengths = table.lengths[self._kept]
        tokens = int(kept_lengths.sum())
        if self._packs is not None and not config.variable_seq_lengths:
            padded_tokens = len(self._packs) * self.capacity
        elif self._packs is not None:
            padded_tokens = int(round_up_array(kept_lengths, config.pad_multiple).sum())
        else:
            padded_tokens = sum(self._padded_size(group) for group in self.epoch_groups(0))
        return {
            "kind": self.kind,
            "layout": "packed" if config.packing else "padded",
            "rows": table.num_rows,
            "rows_kept": len(self._kept),
            "rows_dropped_empty": table.num_empty,
            "rows_dropped_no_loss": table.num_no_loss,
            "rows_truncated": table.num_truncated,
            "tokens": tokens,
            "loss_tokens": int(table.loss_tokens[self._kept].sum()),
            "padded_tokens": padded_tokens,
            "micro_batches": self.num_micro_batches,
            "capacity": self.capacity if config.packing else None,
            "packing_efficiency": tokens / padded_tokens if padded_tokens else 0.0,
        }

    def _padded_size(self, group: tuple[int, ...]) -> int:
        lengths = self.table.lengths[list(group)]
        if self.config.variable_seq_lengths:
            length = round_up(int(lengths.max()), padded_multiple(self.config.pad_multiple))
        else:
            length = self.config.fixed_length
        return lengths.size * length


def format_stats(stats: dict[str, Any]) -> str:
    """The one log line a run prints about its data."""
    layout = f"packed, capacity {stats['capacity']}" if stats["layout"] == "packed" else "padded"
    return (
        f"data ({stats['kind']}): {stats['rows']} rows, {stats['rows_kept']} kept "
        f"(dropped {stats['rows_dropped_empty']} empty, {stats['rows_dropped_no_loss']} without loss tokens; "
        f"{stats['rows_truncated']} reach cutoff_len and were truncated), {stats['tokens']} tokens "
        f"({stats['loss_tokens']} with loss), "
        f"{stats['micro_batches']} micro-batches per epoch ({layout}), "
        f"efficiency {100 * stats['packing_efficiency']:.1f}% real tokens"
    )


class MicroBatchIterator:
    """One data-parallel rank's share of the global stream, crossing epochs.

    Global micro-batch ``g`` (epoch ``g // per_epoch``) goes to rank ``g % dp_size``; iteration starts at the
    first ``g >= consumed`` of this rank. Creating it reads nothing; each ``next`` reads one micro-batch.
    """

    def __init__(self, plan: DataPlan, dp_rank: int = 0, dp_size: int = 1, consumed: int = 0,
                 multiple_of: int = 1, tail: str = "keep", epochs: int | None = None) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size}).")
        if consumed < 0:
            raise ValueError(f"consumed={consumed} must be >= 0.")
        self.plan = plan
        self.dp_size = dp_size
        self.per_epoch = plan.micro_batches_per_epoch(multiple_of, tail)
        if self.per_epoch == 0:
            raise ValueError(
                f"The dataset gives {plan.num_micro_batches} micro-batches per epoch, fewer than one step needs "
                f"({multiple_of} = dp x gradient_accumulation_steps). Use more data, a smaller batch or less "
                "gradient accumulation."
            )
        self.next_global = consumed + (dp_rank - consumed) % dp_size
        self.end = None if epochs is None else epochs * self.per_epoch

    def __iter__(self) -> MicroBatchIterator:
        return self

    def __len__(self) -> int:
        if self.end is None:
            raise TypeError("An iterator without an epoch limit has no length.")
        return max(0, -(-(self.end - self.next_global) // self.dp_size))

    def __next__(self) -> MicroBatch:
        if self.end is not None and self.next_global >= self.end:
            raise StopIteration
        epoch, index = divmod(self.next_global, self.per_epoch)
        self.next_global += self.dp_size
        return self.plan.micro_batch(epoch, index)
