"""Tokenized rows -> micro-batches: packed (THD + cu_seqlens) or padded, DP-sharded and resumable.

The trainer's entry points: ``BatchingConfig`` (how), ``DataPlan`` (which rows form which micro-batch, per
epoch; stats), ``DataPlan.steps`` (one rank's micro-batches per optimizer step from a resume point) and
``MicroBatch``.
"""

from .batch import IGNORE_INDEX, MicroBatch
from .loader import BatchingConfig, DataPlan, Step, check_trainable, empty_rows_warning, format_stats
from .packing import collate_packed, collate_padded, pack_window_ffd
from .rows import PAIRWISE, PT, SFT, RowTable, Sample, detect_kind, scan_rows


__all__ = [
    "IGNORE_INDEX",
    "PAIRWISE",
    "PT",
    "SFT",
    "BatchingConfig",
    "DataPlan",
    "MicroBatch",
    "RowTable",
    "Sample",
    "Step",
    "check_trainable",
    "collate_packed",
    "collate_padded",
    "detect_kind",
    "empty_rows_warning",
    "format_stats",
    "pack_window_ffd",
    "scan_rows",
]
