"""LLaMA-Factory's tokenized rows: their kind, a cheap one-pass length scan, and the shifted sequences.

Our workflow asks ``get_dataset`` for ``cutoff_len + 1`` tokens per row because the shift happens here,
inside each sequence: ``tokens = ids[:-1]`` and ``targets = labels[1:]`` (pretraining: ``ids[1:]``). A row
therefore gives at most ``cutoff_len`` positions, and no target ever belongs to a neighbouring sequence.

A reward model's pairs (``reward``: LLaMA-Factory's rm rows, tokenized to ``cutoff_len`` as its own rm stage does)
are not shifted: every token is a position, and the one target of a sequence marks its last token, the one its
score is read at (``trainer/loss.py``'s ``reward_loss``) wherever packing, padding or context parallelism puts it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import UserError
from .batch import IGNORE_INDEX


if TYPE_CHECKING:
    from datasets import Dataset


PT, SFT, PAIRWISE, REWARD, FEEDBACK = "pt", "sft", "pairwise", "reward", "feedback"
KTO_TAG = "kto_tags"  # LLaMA-Factory's kto rows: True where the answer is desirable
DOCUMENT_START = "document_start"  # pt pieces (split_documents): False where a piece continues a document
MEDIA_COLUMNS = ("images", "videos")  # LLaMA-Factory keeps a row's images and videos (paths) beside its tokens
AUDIO_COLUMN = "audios"  # and its audios, which no model here takes
# A feedback (KTO) row's second sequence is its prompt with another row's answer: the KL estimate's sample.
_PREFIXES = {PT: ("",), SFT: ("",), PAIRWISE: ("chosen_", "rejected_"), REWARD: ("chosen_", "rejected_"),
             FEEDBACK: ("", "kl_")}


def detect_kind(column_names: list[str], reward: bool = False) -> str:
    """``pairwise`` (LLaMA-Factory's "rm" processing, used for DPO; ``reward`` with ``reward``: a reward model's),
    ``feedback`` (its "kto" processing), ``sft`` (has labels) or ``pt``."""
    if "kl_input_ids" in column_names:
        return FEEDBACK
    if "chosen_input_ids" in column_names:
        missing = [f"{p}{c}" for p in _PREFIXES[PAIRWISE] for c in ("input_ids", "labels")
                   if f"{p}{c}" not in column_names]
        if missing:
            raise ValueError(f"Pairwise dataset lacks columns {missing}; got {column_names}.")
        return REWARD if reward else PAIRWISE
    if "input_ids" not in column_names:
        raise ValueError(f"Dataset has no input_ids column (got {column_names}); is it tokenized?")
    return SFT if "labels" in column_names else PT


def columns_for(kind: str, column_names: list[str]) -> list[str]:
    """The columns collation reads: ids, labels, where a pt piece starts its document, and images and videos."""
    wanted = [f"{p}{c}" for p in _PREFIXES[kind] for c in ("input_ids", "labels") if kind != PT or c != "labels"]
    if kind == PT and DOCUMENT_START in column_names:
        wanted.append(DOCUMENT_START)
    if kind == FEEDBACK:
        wanted.append(KTO_TAG)
    wanted += [c for c in MEDIA_COLUMNS if c in column_names]
    return wanted


@dataclass(frozen=True)
class RowTable:
    """Per-row facts from one scan: enough to plan every epoch without touching the tokens again."""

    kind: str
    lengths: np.ndarray  # int64 [rows, sequences per row]: positions after truncation and shift
    keep: np.ndarray  # bool [rows]: something to predict and at least one loss token (both sides of a pair)
    loss_tokens: np.ndarray  # int64 [rows]
    continues: np.ndarray  # bool [rows]: a pt piece that continues a document (its first token was counted before)
    split: bool  # rows are pieces of documents (split_documents)
    num_short: int  # dropped: fewer than two tokens, nothing to predict
    num_no_loss: int
    num_truncated: int
    # The dataset's own text, as opposed to the tokens the chat template puts around it (``data/content.py``);
    # without the template's tokens every token counts as the dataset's.
    content_tokens: np.ndarray  # int64 [rows]: tokens within cutoff_len that are not the template's
    content_loss_tokens: np.ndarray  # int64 [rows]: loss tokens that are not the template's

    @property
    def num_rows(self) -> int:
        return len(self.keep)

    @property
    def sequences_per_row(self) -> int:
        return self.lengths.shape[1]

    @property
    def data_tokens(self) -> np.ndarray:
        """Per row, the dataset tokens it trains: positions, plus each sequence's last token unless shared (or a
        position itself: ``REWARD``)."""
        return self.lengths.sum(axis=1) + np.where(self.continues | (self.kind == REWARD), 0, self.sequences_per_row)

    @property
    def empty(self) -> np.ndarray:
        """bool [rows]: kept rows with nothing of the dataset's own, only the template's tokens (an alpaca row with
        empty instruction, input and output)."""
        return self.keep & (self.content_tokens == 0)

    @property
    def empty_answer(self) -> np.ndarray:
        """bool [rows]: kept sft rows and pairs with text of their own whose loss falls on template tokens only (an
        empty output: only the end of the turn is learned). Not for pt, where a document's last piece may hold
        one token and the end of text."""
        return self.keep & (self.content_tokens > 0) & (self.content_loss_tokens == 0) & (self.kind != PT)


def _list_lengths(column: Any) -> np.ndarray:
    import pyarrow.compute as pc  # here: only datasets' Arrow columns reach it

    return pc.fill_null(pc.list_value_length(column), 0).to_numpy().astype(np.int64)


def _count_per_row(column: Any, first: int, last: int, pick: Any) -> np.ndarray:
    """Per row, how many of its values at positions ``first``..``last`` (inclusive) ``pick`` accepts, vectorised."""
    lengths = _list_lengths(column)
    values = column.flatten().to_numpy(zero_copy_only=False)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    counts = pick(values) & (within >= first) & (within <= last)
    return np.bincount(rows, weights=counts, minlength=len(lengths)).astype(np.int64)


def _loss_counts(labels: Any, cutoff_len: int, own: Any) -> tuple[np.ndarray, np.ndarray]:
    """Targets that count per row (labels[1 : cutoff_len + 1] that are not IGNORE_INDEX), and how many of them are
    the dataset's own tokens (``own``)."""
    trained = _count_per_row(labels, 1, cutoff_len, lambda v: v != IGNORE_INDEX)
    return trained, _count_per_row(labels, 1, cutoff_len, lambda v: (v != IGNORE_INDEX) & own(v))


def scan_rows(dataset: Dataset, kind: str, cutoff_len: int, batch_size: int = 1024,
              template_tokens: np.ndarray | None = None) -> RowTable:
    """Lengths, loss presence and the dataset's own tokens of every row, read through Arrow in batches (no Python
    per token). ``template_tokens``: the ids the chat template adds around a row's text (``data/content.py``)."""
    prefixes = _PREFIXES[kind]
    template = np.unique(np.asarray(template_tokens if template_tokens is not None else [], dtype=np.int64))

    def own(values: np.ndarray) -> np.ndarray:
        return ~np.isin(values, template)

    lengths, losses, truncated, continues, content, content_loss = [], [], [], [], [], []
    split = DOCUMENT_START in dataset.column_names  # pieces of documents: long ones were split, not truncated
    for table in dataset.with_format("arrow").iter(batch_size=batch_size):
        if AUDIO_COLUMN in table.column_names and any(table.column(AUDIO_COLUMN).to_pylist()):
            # their placeholder tokens would train with no sound behind them
            raise UserError("the dataset has audios (its audios column): audio inputs are not supported with "
                            "USE_MCA=1. Drop the dataset's audios column, or unset USE_MCA.")
        if split:
            continues.append(~table.column(DOCUMENT_START).to_numpy(zero_copy_only=False).astype(bool))
        else:
            continues.append(np.zeros(table.num_rows, dtype=bool))
        seq_lengths, seq_losses, seq_truncated = [], [], []
        own_tokens = own_loss = np.zeros(table.num_rows, dtype=np.int64)
        for prefix in prefixes:
            ids = table.column(f"{prefix}input_ids").combine_chunks()
            count = _list_lengths(ids)
            unshifted = kind == REWARD
            positions = np.minimum(count, cutoff_len) if unshifted else np.clip(np.minimum(count, cutoff_len + 1) - 1,
                                                                                 0, None)
            seq_lengths.append(positions)
            # LLaMA-Factory already cut rows to cutoff_len + 1 tokens (reward: cutoff_len): reaching it means truncated
            seq_truncated.append(np.zeros(len(count), dtype=bool) if split else count >= cutoff_len + 1 - unshifted)
            own_tokens = own_tokens + _count_per_row(ids, 0, cutoff_len, own)
            if kind == PT:
                seq_losses.append(positions)
                own_loss = own_loss + _count_per_row(ids, 1, cutoff_len, own)
            else:
                trained, trained_own = _loss_counts(table.column(f"{prefix}labels").combine_chunks(), cutoff_len, own)
                # a reward model's one target per sequence (its score); the answer's own tokens still tell empty ones
                seq_losses.append((positions > 0).astype(np.int64) if unshifted else trained)
                own_loss = own_loss + trained_own
        lengths.append(np.stack(seq_lengths, axis=1))
        losses.append(np.stack(seq_losses, axis=1))
        truncated.append(np.any(np.stack(seq_truncated, axis=1), axis=1))
        content.append(own_tokens)
        content_loss.append(own_loss)
    width = len(prefixes)

    def joined(parts: list, shape: tuple, dtype: Any) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(shape, dtype=dtype)

    lengths_all = joined(lengths, (0, width), np.int64)
    losses_all = joined(losses, (0, width), np.int64)
    short = np.any(lengths_all == 0, axis=1)
    no_loss = ~short & np.any(losses_all == 0, axis=1)
    return RowTable(
        kind=kind,
        lengths=lengths_all,
        keep=~short & ~no_loss,
        loss_tokens=losses_all.sum(axis=1),
        continues=joined(continues, (0,), bool),
        split=split,
        num_short=int(short.sum()),
        num_no_loss=int(no_loss.sum()),
        num_truncated=int(joined(truncated, (0,), bool).sum()),
        content_tokens=joined(content, (0,), np.int64),
        content_loss_tokens=joined(content_loss, (0,), np.int64),
    )


@dataclass
class Sample:
    """One planned unit: a row (pt/sft), a pair (chosen, rejected) or a KTO row (its answer, the KL sample), as
    shifted (tokens, targets) arrays."""

    sequences: list[tuple[np.ndarray, np.ndarray]]
    ref_logps: tuple[float, float] | None = None
    desirable: bool = False  # a KTO row's tag
    continues: bool = False  # a pt piece after the first of its document
    unshifted: bool = False  # a reward model's sequences: every token a position, the last one's target its score
    filler: bool = False  # a loss-free stand-in row that keeps a short group's shape (collate_padded)
    images: list = field(default_factory=list)  # vision-language rows: as LLaMA-Factory's mm plugin reads them
    videos: list = field(default_factory=list)


def make_sample(row: dict[str, Any], kind: str, cutoff_len: int) -> Sample:
    """Truncate to ``cutoff_len + 1`` tokens, then shift inside the sequence (reward: ``cutoff_len`` tokens, the
    last one's target set)."""
    sequences = []
    for prefix in _PREFIXES[kind]:
        if kind == REWARD:
            ids = np.asarray(row[f"{prefix}input_ids"][:cutoff_len], dtype=np.int64)
            targets = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
            targets[-1:] = ids[-1:]
            sequences.append((ids, targets))
            continue
        ids = np.asarray(row[f"{prefix}input_ids"][: cutoff_len + 1], dtype=np.int64)
        labels = ids if kind == PT else np.asarray(row[f"{prefix}labels"][: cutoff_len + 1], dtype=np.int64)
        sequences.append((ids[:-1], labels[1:]))
    return Sample(sequences, continues=kind == PT and row.get(DOCUMENT_START, True) is False, unshifted=kind == REWARD,
                  desirable=bool(row.get(KTO_TAG, False)), images=list(row.get("images") or []),
                  videos=list(row.get("videos") or []))


def fetch_samples(dataset: Dataset, indices: list[int], kind: str, cutoff_len: int,
                  reference: tuple[np.ndarray, np.ndarray] | None = None) -> list[Sample]:
    """One batched read for a micro-batch's rows (``Dataset.__getitem__`` with a list is a single Arrow take);
    ``reference``: DPO's (chosen, rejected) reference log-probs of every row (KTO's: the answer's and the KL
    sample's), when computed."""
    if not indices:
        return []
    columns = dataset[list(indices)]
    rows = [{name: values[i] for name, values in columns.items()} for i in range(len(indices))]
    samples = [make_sample(row, kind, cutoff_len) for row in rows]
    if reference is not None:
        for sample, index in zip(samples, indices):
            sample.ref_logps = (float(reference[0][index]), float(reference[1][index]))
    return samples


@contextlib.contextmanager
def one_thread_per_worker(num_proc: int | None) -> Iterator[None]:
    """Tokenizing with ``preprocessing_num_workers`` > 1: each of datasets' forked workers runs torch on one thread.

    A forked worker inherits its parent's intra-op thread count (cores / processes per node, see torchrun.py), so four
    workers on a 16-core node ran 64 threads over the image processor's small tensors: 535 rows with a 448-pixel
    image each took 41 s to tokenize instead of 3.7. The parallelism there is the processes'. (Splitting pt documents
    runs no torch op in its workers and needs none of this.)"""
    if not num_proc or num_proc <= 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def split_documents(dataset: Dataset, cutoff_len: int, num_proc: int | None = None) -> Dataset:
    """pt: every document (a row of ``input_ids``) as pieces of ``cutoff_len + 1`` tokens overlapping by one.

    Each piece is its own sequence in a pack, so attention never crosses a document, and every token but a
    document's first is a target exactly once: a piece's last token is the next piece's first (its input), the
    shift inside each sequence happens at collation. The last, shorter piece is kept. ``document_start`` marks a
    document's first piece, for token accounting.
    """
    step = cutoff_len

    def pieces(batch: dict[str, list]) -> dict[str, list]:
        ids_out, starts = [], []
        for ids in batch["input_ids"]:
            start = 0
            while True:
                ids_out.append(ids[start: start + step + 1])
                starts.append(start == 0)
                if start + step + 1 >= len(ids):
                    break
                start += step
        return {"input_ids": ids_out, DOCUMENT_START: starts}

    return dataset.map(pieces, batched=True, remove_columns=dataset.column_names, num_proc=num_proc,
                       desc="Splitting documents into cutoff_len pieces")
