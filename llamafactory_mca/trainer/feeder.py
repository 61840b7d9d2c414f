"""From the data plan to what one rank's model chunks eat, one optimizer step at a time.

A step is ``gradient_accumulation_steps`` micro-batches of this data-parallel rank (the last step of an epoch
takes what is left), each lengthened to the step's one length under pipeline parallelism and cut to this
rank's tokens under context parallelism.
"""

from __future__ import annotations

import functools
import hashlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

from megatron.core import parallel_state as ps

from ..data import DataPlan, MicroBatch
from ..data.context_parallel import for_context_parallel_rank
from ..parallel import ParallelLayout


class StepFeeder:
    """This rank's optimizer steps from a DataPlan, as the model chunks eat them; resumable at a consumed count.

    The plan decides which global micro-batches a step takes (the last step of an epoch takes what is left, see
    ``DataPlan.steps``); this adds what the layout needs: one length per step under pipeline parallelism, a
    micro-batch count that is a multiple of the pipeline size under the interleaved schedule, the CP split.
    """

    def __init__(self, plan: DataPlan, layout: ParallelLayout, fixed_shapes: bool = False, prefetch: int = 0) -> None:
        """``fixed_shapes``: every packed micro-batch described by the same shapes (CUDA graphs replay them);
        ``prefetch``: steps collated ahead on a background thread."""
        self.plan = plan
        self.layout = layout
        self.multiple = layout.pp if layout.vpp else 1
        self.slots = plan.max_sequences if fixed_shapes else None
        self.prefetch = prefetch

    @property
    def micro_batches_per_epoch(self) -> int:
        return self.plan.num_micro_batches

    @functools.cached_property
    def signature(self) -> dict[str, Any]:
        """What a checkpoint's data position means: the epoch's micro-batches (which rows each holds) and the padding
        multiple that shaped packs. A resume whose plan differs continues at the same count, not the same rows."""
        groups = hashlib.sha1(repr(self.plan.epoch_groups(0)).encode()).hexdigest()[:16]
        return {"micro_batches": self.plan.num_micro_batches, "groups": groups,
                "packing": self.plan.config.packing, "pad_multiple": self.plan.config.pad_multiple,
                "micro_batch_size": self.plan.config.micro_batch_size}

    def resume_note(self, saved: dict[str, Any] | None) -> str | None:
        """None if a checkpoint's data position (its ``signature``) means the same rows here; else what differs.
        Keys a checkpoint lacks (written before they were recorded) are taken as this run's."""
        mine = self.signature
        if not saved or all(saved.get(key, value) == value for key, value in mine.items()):
            return None
        size = saved.get("micro_batch_size", mine["micro_batch_size"])
        why = (f"packed with sequences padded to a multiple of {mine['pad_multiple']} instead of "
               f"{saved['pad_multiple']} (the tensor parallel size; 2 x context x tensor parallel sizes with context "
               "parallelism)"
               if mine["packing"] and saved.get("packing") and saved.get("pad_multiple") != mine["pad_multiple"]
               else f"micro-batches of {mine['micro_batch_size']} rows' tokens instead of {size} "
               "(per_device_train_batch_size x merge_micro_batches: the summary's batch line says both)"
               if size != mine["micro_batch_size"]
               else "another dataset, micro-batch size, cutoff_len, packing or seed")
        return (f"this run's micro-batches differ from the checkpoint's ({saved['micro_batches']} -> "
                f"{mine['micro_batches']} per epoch: {why}): the epoch in progress continues at the same count of "
                "micro-batches, so some of its rows may be trained twice or not at all; later epochs are whole. "
                "Resume with the checkpoint's settings to continue exactly.")

    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch(self.layout.dp, self.layout.grad_accum)

    def steps(self, start: int = 0, epochs: int | None = None, step_before: int | None = None
              ) -> Iterator[tuple[list[MicroBatch], int]]:
        """(this rank's micro-batches of the step, global micro-batches consumed after it); ``step_before``: a
        resumed checkpoint's global micro-batches per step."""
        # expert parallel groups span data-parallel ranks: their all-to-alls need every rank at every micro-batch
        planned = self.plan.steps(ps.get_data_parallel_rank(), self.layout.dp, self.layout.grad_accum,
                                  self.multiple, equal_counts=self.layout.ep > 1, consumed=start, epochs=epochs,
                                  step_before=step_before)
        return ahead(((self._step(step.micro_batches), step.consumed) for step in planned), self.prefetch)

    def _step(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        batches = micro_batches
        if self.layout.pp > 1:
            # One length per step under pipeline parallelism, so the schedule runs without its per-micro-batch shape
            # exchange (variable_seq_lengths off, see models/auto.py). That exchange posts a send whose receive the
            # next stage posts only after a send of its own; where sends wait for their receive (gloo), PP2 x VPP2
            # with as many micro-batches as stages deadlocked. It also costs a host sync per transfer.
            length = max(b.tokens.shape[1] for b in batches)
            batches = [b.padded_to(length) for b in batches]
        if self.slots:
            batches = [b.with_slots(self.slots) for b in batches]
        cp_rank, cp_size = ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()
        return [for_context_parallel_rank(b, cp_rank, cp_size) for b in batches]

    def eval_steps(self) -> Iterator[list[MicroBatch]]:
        """One pass over the evaluation set."""
        for batches, _ in self.steps(epochs=1):
            yield batches

    def tokens_per_step(self) -> int:
        """Average real tokens per optimizer step over an epoch."""
        return int(self.plan.stats["tokens"] / max(self.steps_per_epoch(), 1))


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def ahead(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """``items``, produced up to ``depth`` ahead on a background thread.

    Collating a step (reading rows, packing, and for a vision-language model its pixels and 3-D positions) then runs
    while the GPU works on the step before, instead of in front of it. Order, values and errors are the same as
    without: an error raised while producing an item is raised here when that item is due. The thread stops when
    the consumer lets go of this generator (the run ends, or it stops at max_steps).
    """
    if depth <= 0:
        yield from items
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_END)
        except BaseException as error:  # noqa: BLE001 -- handed to the consumer, raised there
            put(_Failed(error))

    threading.Thread(target=produce, name="llamafactory-mca-collate", daemon=True).start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
