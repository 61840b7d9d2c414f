"""What ``e2e_bench.py`` launches in place of ``llamafactory-cli train recipe.yaml``: the same ``run_exp``, plus a
callback that times steps and counts real tokens. Nothing in LLaMA-Factory or llamafactory_mca is edited.

The bench launches it the way LLaMA-Factory's launcher launches ``launcher.py`` (torchrun when ``USE_MCA=1`` or
more than one GPU, else a plain process), with these variables:

- ``E2E_BENCH_OUT``: folder for ``rank<N>.json`` (written after every step, and at the end);
- ``E2E_BENCH_T0``: the launch time (``time.time()`` in the bench) — time to first step counts from it;
- ``E2E_BENCH_PACKED=1``: LLaMA-Factory path only — batches are packed (sequences restart at position 0);
- ``E2E_BENCH_EXIT=1``: leave right after the training loop (no final ``save_model``: nobody reads it);
- ``E2E_BENCH_PROFILE_STEP=N``: step N runs under torch.profiler, from its ``on_step_begin`` to its ``on_step_end``,
  and its record holds the kernel launches and GPU busy share counted as ``profile_step.py`` counts them
  (``kernels_rank<N>.txt`` beside it: the step's top kernels by GPU time). The bench profiles one step after the
  measured ones, so the profiler's overhead stays out of tokens/s;
- ``E2E_BENCH_OPS=1`` (the bench's ``--ops``): that step records the host's ops too, with their input shapes and
  Python stacks (``ops_rank<N>.txt``: which op spent the GPU time, by shape and by stack). The step is slower for it,
  so its GPU busy share reads low.

LLaMA-Factory path: the HF Trainer's ``training_step`` is wrapped to note, per micro-batch, which positions hold a
real token (2-D ``attention_mask``, or the diagonal of ``neat_packing``'s 4-D mask) and the sequence lengths the
model computes on (packed: each sequence; padded: every row at its padded length, as llamafactory_mca counts
them). Our path: McaTrainer logs every step; its state's ``num_input_tokens_seen`` and ``total_flos`` grow by the
step's real tokens and model FLOPs over all ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time

from llamafactory_mca.models.reference import EAGER_REFERENCE


# a rank forked by our torchrun runs this file through runpy, which leaves this folder off the import path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
T0 = float(os.environ.get("E2E_BENCH_T0") or time.time())
OURS = os.environ.get("USE_MCA", "0").lower() in ("1", "true", "y", "yes", "on")


class _Recorder:
    """Per-step numbers of this rank, written to ``E2E_BENCH_OUT/rank<N>.json``."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.out = os.environ["E2E_BENCH_OUT"]
        self.packed = os.environ.get("E2E_BENCH_PACKED") == "1"
        self.pending: list = []  # (real mask on device, position ids or None, padded shape) per micro-batch
        self.steps: dict[int, dict] = {}
        self.first_step_s = None
        self.train_begin_s = None  # launch to the trainer's on_train_begin: imports, data, model, optimizer
        self.peak_alloc = 0.0
        self.peak_reserved = 0.0
        self.seen = (0, 0.0)  # ours: state.num_input_tokens_seen, state.total_flos at the previous log
        self.profiled_step = int(os.environ.get("E2E_BENCH_PROFILE_STEP") or 0) or None
        os.makedirs(self.out, exist_ok=True)

    # ---- LLaMA-Factory path: what one micro-batch holds -----------------------------------------------------
    def note_batch(self, inputs: dict) -> None:
        import torch

        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        if torch.is_tensor(mask) and mask.dim() == 2:
            real = mask != 0
        elif torch.is_tensor(mask) and mask.dim() == 4:  # neat_packing without flash-attn: 0 where attending
            diagonal = torch.diagonal(mask[:, 0], dim1=-2, dim2=-1)
            real = diagonal.bool() if mask.dtype == torch.bool else diagonal == 0
        else:
            real = torch.ones_like(ids, dtype=torch.bool)
        positions = inputs.get("position_ids") if self.packed else None
        if torch.is_tensor(positions) and positions.dim() == 3:  # mrope: [axes, b, s]
            positions = positions[0]
        self.pending.append((real.detach(), None if positions is None else positions.detach(), tuple(ids.shape)))

    def _drain(self) -> tuple[int, list[int]]:
        """(real tokens, sequence lengths) of the micro-batches since the last step; the step has synced."""
        import numpy as np

        tokens, seqlens = 0, []
        for real, positions, (rows, length) in self.pending:
            real = real.cpu().numpy()
            tokens += int(real.sum())
            if positions is None:
                seqlens += [length] * rows
                continue
            positions = positions.cpu().numpy()
            for r in range(rows):
                starts = np.flatnonzero((positions[r] == 0) & real[r])
                if starts.size:  # real tokens from each sequence start to the next
                    seqlens += [int(n) for n in np.add.reduceat(real[r].astype(np.int64), starts)]
        self.pending.clear()
        return tokens, seqlens

    # ---- both paths ------------------------------------------------------------------------------------------
    def train_begin(self) -> None:
        if self.train_begin_s is None:
            self.train_begin_s = time.time() - T0

    def step_end(self, step: int, profile: dict | None = None) -> None:
        import torch

        now = time.time()
        if torch.cuda.is_available():
            self.peak_alloc = max(self.peak_alloc, torch.cuda.max_memory_allocated() / 2**30)
            self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved() / 2**30)
        if self.first_step_s is None:
            self.first_step_s = now - T0
        record = self.steps.setdefault(step, {"step": step})
        record["t_end"] = now
        if profile is not None:
            record["profile"] = profile
        if not OURS:
            record["tokens"], record["seqlens"] = self._drain()
        self.write()

    def log(self, step: int, logs: dict, state) -> None:
        if "loss" not in logs or step not in self.steps:
            return
        record = self.steps[step]
        record["loss"] = float(logs["loss"])
        if OURS:
            tokens, flops = state.num_input_tokens_seen, state.total_flos
            record["tokens"], record["flops"] = tokens - self.seen[0], flops - self.seen[1]
            self.seen = (tokens, flops)
            record["self_reported"] = {k: logs[k] for k in ("tokens_per_second_per_gpu", "mfu", "peak_memory_gib")
                                       if k in logs}
        self.write()

    def write(self, done: bool = False) -> None:
        payload = {"rank": self.rank, "world": self.world, "path": "ours" if OURS else "lf",
                   "token_scope": "global" if OURS else "rank", "first_step_s": self.first_step_s,
                   "train_begin_s": self.train_begin_s, "peak_memory_gib": round(self.peak_alloc, 3),
                   "peak_reserved_gib": round(self.peak_reserved, 3),
                   "profiled_step": self.profiled_step, "done": done,
                   "steps": [self.steps[k] for k in sorted(self.steps)]}
        path = os.path.join(self.out, f"rank{self.rank}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(payload, f)
        os.replace(path + ".tmp", path)


class _StepProfiler:
    """torch.profiler around one optimizer step. Both paths call ``on_step_begin`` after the step's micro-batches are
    read and ``on_step_end`` after its optimizer step, so the window is the same training work on either; the GPU is
    synchronised at both ends so the wall time holds exactly the step's kernels."""

    def __init__(self, step: int | None, kernels: str | None = None) -> None:
        import torch

        self.step, self.kernels = step, kernels
        self.cuda = torch.cuda.is_available()
        self.ops = os.environ.get("E2E_BENCH_OPS") == "1"
        self.profile = None
        self.start = 0.0

    def begin(self, step: int) -> None:
        import torch

        if step != self.step:
            return
        # on a GPU the CUDA activity alone: it holds the kernels and the runtime's launch calls, and recording every
        # CPU op besides slowed LLaMA-Factory's profiled step past a minute
        activities = [torch.profiler.ProfilerActivity.CUDA if self.cuda else torch.profiler.ProfilerActivity.CPU]
        if self.ops and self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        if self.cuda:
            torch.cuda.synchronize()
        # Python stacks reach the events only with the verbose experimental config (torch 2.11)
        extra = {"record_shapes": True, "with_stack": True,
                 "experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)} if self.ops else {}
        self.profile = torch.profiler.profile(activities=activities, **extra)
        self.profile.start()
        self.start = time.perf_counter()

    def end(self, step: int) -> dict | None:
        """The step's counts, once its GPU work has finished (the caller has synchronised)."""
        from _profile_counts import step_counts

        if self.profile is None or step != self.step:
            return None
        seconds = time.perf_counter() - self.start
        self.profile.stop()
        events = self.profile.key_averages()
        counts = step_counts(events, 1, seconds, self.cuda)
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        if self.kernels:  # where the step's GPU time goes, beside its counts
            with open(self.kernels, "w", encoding="utf-8") as f:
                f.write(events.table(sort_by=sort, row_limit=40, max_name_column_width=90))
        if self.ops and self.kernels:
            self._write_ops(self.kernels.replace("kernels_rank", "ops_rank"), sort)
        self.profile = None
        return counts

    def _write_ops(self, path: str, sort: str) -> None:
        """The host's ops by the GPU time of the kernels they launched: grouped by input shapes, then by stack."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.profile.key_averages(group_by_input_shape=True).table(
                sort_by=sort, row_limit=60, max_name_column_width=50, max_shapes_column_width=100))
            f.write("\n")
            f.write(self.profile.key_averages(group_by_stack_n=6).table(
                sort_by=sort, row_limit=40, max_name_column_width=50, max_src_column_width=100))


def _callback(recorder: _Recorder):
    import torch
    from transformers import TrainerCallback

    profiler = _StepProfiler(recorder.profiled_step, os.path.join(recorder.out, f"kernels_rank{recorder.rank}.txt"))

    class BenchCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            recorder.train_begin()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, args, state, control, **kwargs):
            profiler.begin(state.global_step + 1)  # global_step counts the steps done

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            recorder.step_end(state.global_step, profiler.end(state.global_step))

        def on_log(self, args, state, control, logs=None, **kwargs):
            recorder.log(state.global_step, logs or {}, state)

        def on_train_end(self, args, state, control, **kwargs):
            recorder.write(done=True)
            if os.environ.get("E2E_BENCH_EXIT") == "1":
                sys.stdout.flush()
                sys.stderr.flush()
                if OURS:  # as our workers leave: a rank forked by our torchrun returns to torch's agent
                    from llamafactory_mca import parallel

                    parallel.end_worker()
                os._exit(0)

    return BenchCallback()


def _eager_attention_where_needed() -> None:
    from llamafactory.model import patcher

    choose = patcher.configure_attn_implementation

    def eager_where_needed(config, model_args):
        if getattr(config, "model_type", None) not in EAGER_REFERENCE:
            return choose(config, model_args)
        setattr(config, "_attn_implementation", "eager")

    patcher.configure_attn_implementation = eager_where_needed


def main() -> None:
    if OURS:  # the .pth startup hook has done this already when the package is installed; install() is idempotent
        from llamafactory_mca.launch import plugin

        plugin.install()
    recorder = _Recorder()
    if not OURS:
        from transformers import Trainer

        training_step = Trainer.training_step

        def counting_training_step(self, model, inputs, *args, **kwargs):
            recorder.note_batch(inputs)
            return training_step(self, model, inputs, *args, **kwargs)

        Trainer.training_step = counting_training_step
        _eager_attention_where_needed()

    from llamafactory.train.tuner import run_exp

    run_exp(callbacks=[_callback(recorder)])
    recorder.write(done=True)


if __name__ == "__main__":
    main()
