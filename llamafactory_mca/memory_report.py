"""Where a run's peak GPU memory goes: the CUDA allocator's history, replayed up to its peak.

``LLAMAFACTORY_MCA_MEMORY_REPORT=FILE`` (rank 0, CUDA only) records the allocator's history from before the
model is built and, after optimizer step ``LLAMAFACTORY_MCA_MEMORY_REPORT_STEPS`` (default 2), writes FILE: a
Markdown table of the allocations alive at the peak, grouped by the line of Megatron, torch's optimizers,
transformers or this package that made them. It answers "which tensors make the peak" without guessing from
bytes-per-parameter sums; recording costs host time, so it stops after the report.
"""

from __future__ import annotations

import collections
import os

import torch


ENV, ENV_STEPS = "LLAMAFACTORY_MCA_MEMORY_REPORT", "LLAMAFACTORY_MCA_MEMORY_REPORT_STEPS"
OURS = ("llamafactory_mca/", "megatron/", "torch/optim/", "transformers/")
_recording = False


def start() -> None:
    """Begin recording if the variable asks for it (rank 0 of a CUDA run)."""
    global _recording
    if not os.environ.get(ENV) or not torch.cuda.is_available() or int(os.environ.get("RANK", "0")) != 0:
        return
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    _recording = True


def maybe_write(step: int) -> None:
    """After the step the variable names: write the report and stop recording."""
    global _recording
    if not _recording or step < int(os.environ.get(ENV_STEPS, "2")):
        return
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    _recording = False
    with open(os.environ[ENV], "w", encoding="utf-8") as f:
        f.write(report(snapshot["device_traces"][torch.cuda.current_device()], step))


def _origin(frames: list[dict]) -> str:
    for frame in frames:  # innermost first
        name = frame["filename"].replace("\\", "/")
        for marker in OURS:
            at = name.rfind(marker)
            if at >= 0:
                return f"{name[at:]}:{frame['line']} {frame['name']}"
    return "(elsewhere)"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replay alloc/free events; return the peak of the bytes they account for and the blocks alive then."""
    current = peak = peak_index = 0
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            current += event["size"]
            if current > peak:
                peak, peak_index = current, index
        elif event["action"] == "free_completed":
            current -= event["size"]
    live: dict[int, dict] = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return peak, list(live.values())


def report(trace: list[dict], step: int, top: int = 25) -> str:
    peak, live = live_at_peak(trace)
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for event in live:
        group = groups[_origin(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    gib = 1024 ** 3
    lines = [f"# Peak GPU memory over the first {step} steps: {peak / gib:.2f} GiB (rank 0)", "",
             f"torch.cuda.max_memory_allocated: {torch.cuda.max_memory_allocated() / gib:.2f} GiB "
             "(since the last reset of the peak; the replay covers the whole recorded history). "
             f"{len(trace):,} allocator events.", "",
             "| allocations alive at the peak, by where they were made | GiB | tensors |", "|---|---:|---:|"]
    for origin, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{origin}` | {size / gib:.2f} | {count:,} |")
    return "\n".join(lines) + "\n"
