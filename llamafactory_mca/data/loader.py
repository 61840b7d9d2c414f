"""The data plan: deterministic, DP-sharded, resumable micro-batches from a tokenized dataset.

The plan is built from row lengths only (one Arrow scan), so every rank can afford it: it answers how
many micro-batches and steps an epoch has. ``DataPlan.steps`` reads rows lazily, one micro-batch at a time.

The stream is global and independent of the data-parallel size: epoch after epoch, global micro-batch
``g`` goes to rank ``g % dp``. An optimizer step takes dp × grad_accum micro-batches; the last step of an
epoch takes what is left (nothing is dropped), each rank running the same count so collectives stay in step
(loss-free stand-ins fill in, see ``Step``). A run resumed with ``consumed`` micro-batches continues the same
stream, even onto a different dp as long as the resume point is a whole step of the new layout.

Epochs: padded micro-batches are cut from the rows shuffled with (seed, epoch). Packs are built once,
from the rows shuffled with the seed, and each epoch shuffles the packs with (seed, epoch): so every
epoch has the same number of micro-batches (the trainer's steps per epoch, learning-rate schedule and
resume arithmetic stay exact and O(1)), while sequences in a pack never see each other (THD), so which
rows share a pack changes only how the loss of a micro-batch is normalised, not what is learned.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UserError
from .batch import MicroBatch
from .packing import (
    chunk,
    collate_packed,
    collate_padded,
    pack_length,
    pack_window_ffd,
    padded_multiple,
    round_up,
    round_up_array,
)
from .rows import FEEDBACK, PAIRWISE, REWARD, RowTable, columns_for, detect_kind, fetch_samples, scan_rows


if TYPE_CHECKING:
    from datasets import Dataset


logger = logging.getLogger(__name__)

_PACK_STREAM, _EPOCH_STREAM = 0, 1  # separate random streams: the packing order and each epoch's shuffle


@dataclass
class Step:
    """One rank's micro-batches of an optimizer step and where the global stream stands after it."""

    micro_batches: list[MicroBatch]
    consumed: int  # global micro-batches consumed after this step (real ones: stand-ins do not count)
    epoch: int


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
    equal_rows: bool = False  # every padded micro-batch has micro_batch_size rows (pipeline parallel transfers)
    padding_free: bool = False  # unpacked micro-batches run as THD rows: the same rows without their padding
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
                  padding_free: bool = False, micro_batch_size: int | None = None,
                  for_eval: bool = False) -> BatchingConfig:
        """From our TrainingArguments. ``cutoff_len``, ``packing`` and ``padding_free`` come from the plan, because
        LLaMA-Factory's ``DataArguments`` lowers ``cutoff_len`` by one when its own packing is on;
        ``micro_batch_size``: the plan's for training (merged micro-batches), else the recipe's."""
        micro = args.per_device_eval_batch_size if for_eval else micro_batch_size or args.per_device_train_batch_size
        seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
        return cls(cutoff_len=cutoff_len, micro_batch_size=micro, packing=packing, pad_multiple=pad_multiple,
                   variable_seq_lengths=args.allow_variable_seq_lengths(), pad_token_id=pad_token_id, seed=seed,
                   shuffle=not for_eval, equal_rows=getattr(args, "pipeline_model_parallel_size", 1) > 1,
                   padding_free=padding_free and not packing)

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

    def __init__(self, dataset: Dataset, config: BatchingConfig, log: bool = True, vision: Any = None,
                 template_tokens: np.ndarray | None = None, reward: bool = False) -> None:
        """``vision``: a ``data.multimodal.VisionInputs`` for vision-language models (pixels, 3-D positions).
        ``template_tokens``: the ids the chat template adds around a row's text (``data/content.py``), to count the
        rows with no text of their own; without them every token counts as the dataset's. ``reward``: pairs for a
        reward model (``rows.REWARD``)."""
        if not hasattr(dataset, "select_columns") or not hasattr(dataset, "__len__"):
            raise TypeError(
                f"DataPlan needs a map-style datasets.Dataset, got {type(dataset).__name__}; streaming datasets "
                "cannot be planned, shuffled or resumed exactly. Set streaming: false."
            )
        self.config, self.vision = config, vision
        self.kind = detect_kind(dataset.column_names, reward)
        self.table: RowTable = scan_rows(dataset, self.kind, config.cutoff_len, template_tokens=template_tokens)
        self._dataset = dataset.select_columns(columns_for(self.kind, dataset.column_names))
        self._kept = np.flatnonzero(self.table.keep)
        # tokens each row takes in a THD row: its sequences, each padded to pad_multiple
        self._sizes = round_up_array(self.table.lengths, config.pad_multiple).sum(axis=1)
        self._packs: list[tuple[int, ...]] | None = None
        if config.packing:
            order = _rng(config.seed, _PACK_STREAM).permutation(self._kept) if config.shuffle else self._kept
            self._packs = pack_window_ffd(self._sizes, order, self.capacity, config.pack_window)
        self._epochs: dict[int, list[tuple[int, ...]]] = {}  # the last two epochs asked for
        self._stand_in: MicroBatch | None = None
        self.reference: tuple[np.ndarray, np.ndarray] | None = None  # DPO: per row (chosen, rejected) log-probs
        self.stats = self._stats()
        if log:
            logger.info(format_stats(self.stats))

    @property
    def pairwise(self) -> bool:
        """Two sequences per row that the loss reads together: DPO's and a reward model's pairs, KTO's rows."""
        return self.kind in (PAIRWISE, REWARD, FEEDBACK)

    @property
    def capacity(self) -> int:
        return self.config.capacity(self.table.sequences_per_row)

    @property
    def max_sequences(self) -> int:
        """The most sequences any micro-batch of any epoch holds (epochs reorder the same packs)."""
        groups = self._packs if self._packs is not None else self.epoch_groups(0)
        return max((len(g) for g in groups), default=1) * self.table.sequences_per_row

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches in every epoch."""
        if self._packs is not None:
            return len(self._packs)
        return -(-len(self._kept) // self.config.micro_batch_size)

    def steps_per_epoch(self, dp_size: int, grad_accum: int) -> int:
        """Optimizer steps per epoch, the last one taking what is left."""
        return -(-self.num_micro_batches // (dp_size * grad_accum))

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
        samples = fetch_samples(self._dataset, list(group), self.kind, config.cutoff_len, self.reference)
        if config.packing or config.padding_free:
            total = None if config.variable_seq_lengths else self.capacity
            batch = collate_packed(samples, config.pad_multiple, config.pad_token_id, self.pairwise, total,
                                   capacity=self.capacity)
        else:
            fixed = None if config.variable_seq_lengths else config.fixed_length
            rows = config.micro_batch_size if config.equal_rows or fixed else None
            batch = collate_padded(samples, config.pad_multiple, config.pad_token_id, self.pairwise, fixed, rows)
        return batch if self.vision is None else self.vision.attach(batch, samples)

    def set_reference(self, chosen: np.ndarray, rejected: np.ndarray) -> None:
        """DPO's reference log-probs, one pair per row, computed once before training (``McaTrainer``); every
        micro-batch collated from now on carries its rows' values."""
        self.reference = (chosen, rejected)
        self._stand_in = None

    def micro_batch(self, epoch: int, index: int) -> MicroBatch:
        """Micro-batch ``index`` of ``epoch``."""
        return self.collate(self.epoch_groups(epoch)[index])

    def stand_in(self) -> MicroBatch:
        """A loss-free micro-batch for a rank with nothing left in a step: it trains and counts nothing. (Under
        expert parallelism its tokens are routed too, so that step's router load-balancing loss sees them.)"""
        if self._stand_in is None:
            self._stand_in = self.collate(min(self.epoch_groups(0), key=len)).without_loss()
        return self._stand_in

    def steps(self, dp_rank: int = 0, dp_size: int = 1, grad_accum: int = 1, multiple_of: int = 1,
              equal_counts: bool = False, consumed: int = 0, epochs: int | None = None,
              step_before: int | None = None) -> Iterator[Step]:
        """This rank's steps from global position ``consumed`` on (``epochs`` epochs, or forever).

        A step covers the next dp × grad_accum global micro-batches, or the rest of the epoch; the rank takes every
        dp-th one starting at its rank. In an epoch's last step ranks may get one fewer, or none: a rank runs what
        it got (a stand-in if nothing), all ranks the same count where collectives inside the step span them
        (``equal_counts``: expert parallelism), rounded up to ``multiple_of`` (the pipeline size under the
        interleaved schedule); stand-ins make up the difference. ``step_before``: the global micro-batches of a
        step of the run that wrote the resume point, for the advice when this layout splits its steps.
        """
        n, per_step = self.num_micro_batches, dp_size * grad_accum
        if n == 0:
            raise UserError(f"the dataset has no row left to train on: {nothing_left(self.stats)}")
        epoch, offset = divmod(consumed, n)
        if offset % per_step:
            raise UserError(f"resume point {consumed} is not a whole step of dp {dp_size} x "
                            f"gradient_accumulation_steps {grad_accum} = {per_step} micro-batches into its epoch of "
                            f"{n}: this layout changes the global batch and splits a step. "
                            f"{_keep_the_global_batch(step_before, dp_size)}")
        while epochs is None or epoch < epochs:
            while offset < n:
                taken = min(per_step, n - offset)
                mine = [offset + g for g in range(dp_rank, taken, dp_size)]
                count = -(-taken // dp_size) if equal_counts else max(len(mine), 1)
                count = round_up(count, multiple_of)
                batches = [self.micro_batch(epoch, g) for g in mine]
                batches += [self.stand_in()] * (count - len(batches))
                offset += taken
                yield Step(batches, epoch * n + offset, epoch)
            epoch, offset = epoch + 1, 0

    def _stats(self) -> dict[str, Any]:
        table, config = self.table, self.config
        kept_lengths = table.lengths[self._kept]
        tokens = int(kept_lengths.sum())
        if self._packs is not None and not config.variable_seq_lengths:
            padded_tokens = len(self._packs) * self.capacity
        elif self._packs is not None or config.padding_free:
            groups = self._packs if self._packs is not None else self.epoch_groups(0)
            padded_tokens = sum(self._packed_size(group) for group in groups)
        else:
            padded_tokens = sum(self._padded_size(group) for group in self.epoch_groups(0))
        return {
            "kind": self.kind,
            "layout": "packed" if config.packing else "padding-free" if config.padding_free else "padded",
            "rows": table.num_rows,
            "rows_kept": len(self._kept),
            "rows_dropped_short": table.num_short,
            "rows_dropped_no_loss": table.num_no_loss,
            "rows_empty": int(table.empty.sum()),
            "rows_empty_answer": int(table.empty_answer.sum()),
            "rows_truncated": table.num_truncated,
            "tokens": tokens,
            "data_tokens": int(table.data_tokens[self._kept].sum()),
            "documents": int((~table.continues).sum()),
            "pieces": table.num_rows if table.split else None,
            "loss_tokens": int(table.loss_tokens[self._kept].sum()),
            "content_loss_tokens": int(table.content_loss_tokens[self._kept].sum()),
            "cutoff_len": config.cutoff_len,
            "padded_tokens": padded_tokens,
            "micro_batches": self.num_micro_batches,
            "capacity": self.capacity if config.packing else None,
            "packing_efficiency": tokens / padded_tokens if padded_tokens else 0.0,
        }

    def _packed_size(self, group: tuple[int, ...]) -> int:
        return pack_length(int(self._sizes[list(group)].sum()), self.config.pad_multiple, self.capacity)

    def _padded_size(self, group: tuple[int, ...]) -> int:
        lengths = self.table.lengths[list(group)]
        if self.config.variable_seq_lengths:
            length = round_up(int(lengths.max()), padded_multiple(self.config.pad_multiple))
        else:
            length = self.config.fixed_length
        return lengths.size * length


def format_stats(stats: dict[str, Any]) -> str:
    """The one log line a run prints about its data."""
    layout = {"packed": f"packed, capacity {stats['capacity']}", "padding-free": "rows without padding, THD"
              }.get(stats["layout"], "padded")
    rows = f"{stats['rows']} rows"
    if stats.get("pieces"):
        rows = f"{stats['documents']} documents in {stats['pieces']} pieces of at most cutoff_len"
    empty = "".join(f", {stats[key]} {words}" for key, words in (
        ("rows_empty", "empty (nothing but template tokens)"),
        ("rows_empty_answer", "with an empty answer (loss on template tokens only)")) if stats.get(key))
    return (
        f"data ({stats['kind']}): {rows}, {stats['rows_kept']} kept{empty} "
        f"(dropped {stats['rows_dropped_short']} with nothing to predict, {stats['rows_dropped_no_loss']} without "
        "loss tokens; "
        f"{stats['rows_truncated']} reach cutoff_len and were truncated), {stats['data_tokens']} tokens "
        f"({stats['loss_tokens']} with loss), "
        f"{stats['micro_batches']} micro-batches per epoch ({layout}), "
        f"efficiency {100 * stats['packing_efficiency']:.1f}% real tokens"
    )


def nothing_left(stats: dict[str, Any]) -> str:
    """Why no row of a dataset is left to train on, from its stats (said before any summary is printed)."""
    return (f"of {stats['rows']} rows read, {stats['rows_dropped_short']} have fewer than two tokens (nothing to "
            f"predict) and {stats['rows_dropped_no_loss']} no loss token within cutoff_len={stats['cutoff_len']} (the "
            "prompt fills cutoff_len, or every label is masked). Check the dataset's columns in dataset_info.json, or "
            "raise cutoff_len.")


def check_trainable(stats: dict[str, Any], dataset: str) -> None:
    """Refuse a training set with no row left, or whose loss would fall on nothing but the chat template's tokens
    (every row empty, or every answer: what a wrong column mapping reads as)."""
    if not stats["rows_kept"]:
        raise UserError(f"dataset={dataset} has no row left to train on: {nothing_left(stats)}")
    if stats["content_loss_tokens"]:
        return
    if stats["kind"] == "pt":
        found, learned = f"{stats['rows_empty']} of them empty", "the end of a text"
    else:
        found = f"{stats['rows_empty']} empty, {stats['rows_empty_answer']} with an empty answer"
        learned = "the end of a turn"
    raise UserError(f"dataset={dataset}: nothing but the chat template's tokens would carry loss in its "
                    f"{stats['rows_kept']} rows ({found}): training would only teach {learned}. Check that the "
                    "dataset's text is where dataset_info.json's \"columns\" say it is (the file's field names), "
                    "and that the fields are not empty.")


def empty_rows_warning(stats: dict[str, Any], dataset: str) -> str | None:
    """A line about the rows with no text of their own, or whose loss falls on template tokens only: kept and
    trained, as LLaMA-Factory's default path trains them, but rarely meant."""
    empty, answers = stats["rows_empty"], stats["rows_empty_answer"]
    if not empty and not answers:
        return None
    parts = [f"{empty} empty (nothing but the chat template's tokens)"] if empty else []
    parts += [f"{answers} with an empty answer (loss on template tokens only)"] if answers else []
    learned = "to end a text at once" if stats["kind"] == "pt" else "to end its turn at once"
    return (f"dataset={dataset}: {' and '.join(parts)} of {stats['rows_kept']} rows; they are trained, as LLaMA-"
            f"Factory's default path trains them, teaching the model {learned}. Remove them from the data if that is "
            "not what they are for.")


def _keep_the_global_batch(step_before: int | None, dp_size: int) -> str:
    """The accumulation that keeps the checkpoint's global batch under ``dp_size``, where one does."""
    if step_before and step_before % dp_size == 0:
        return (f"The checkpoint's steps took {step_before} micro-batches: gradient_accumulation_steps: "
                f"{step_before // dp_size} keeps its global batch at dp {dp_size}.")
    if step_before:
        return (f"The checkpoint's steps took {step_before} micro-batches, which dp {dp_size} does not divide: choose "
                f"a data-parallel size that divides {step_before} (gradient_accumulation_steps: {step_before} / dp).")
    return "Resume with the data-parallel size and gradient_accumulation_steps the checkpoint was written with."
