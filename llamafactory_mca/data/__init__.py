"""Tokenized rows -> micro-batches: packed (THD + cu_seqlens) or padded, DP-sharded and resumable.

The trainer's entry points: ``BatchingConfig`` (how), ``DataPlan`` (which rows form which micro-batch, per
epoch; stats), ``DataPlan.iterator`` (one rank's micro-batches from a resume point) and ``MicroBatch``.
"""

from .batch import IGNORE_INDEX, MicroBatch
from .loader import BatchingConfig, DataPlan, MicroBatchIterator, format_stats
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
    "MicroBatchIterator",
    "RowTable",
    "Sample",
    "collate_packed",
    "collate_padded",
    "detect_kind",
    "format_stats",
    "pack_window_ffd",
    "scan_rows",
]
