"""A progress bar on rank 0 and one readable line per logging step; LLaMA-Factory's trainer_log.jsonl on resume."""

from __future__ import annotations

import json
import os

from llamafactory.extras.constants import TRAINER_LOG
from tqdm.auto import tqdm
from transformers import TrainerCallback


def forget_logs_after(output_dir: str, step: int) -> int:
    """Drop the entries of LLaMA-Factory's ``trainer_log.jsonl`` past ``step`` (those a resumed run trains again),
    so its loss plot and LlamaBoard's progress read one history. LLaMA-Factory's default path appends instead, and
    steps between the checkpoint and the crash appear twice. Returns how many entries went."""
    path = os.path.join(output_dir, TRAINER_LOG)
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut short by the crash
            continue
        if int(entry.get("current_steps", 0)) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return len(lines) - len(kept)


def format_logs(step: int, max_steps: int, logs: dict) -> str:
    parts = [f"step {step}/{max_steps}"]
    for key, label, fmt in (("loss", "loss", ".4f"), ("eval_loss", "eval loss", ".4f"), ("grad_norm", "grad norm",
                            ".3f"), ("learning_rate", "lr", ".3g"), ("tokens_per_second_per_gpu", "tok/s/GPU", ",.0f"),
                            ("mfu", "MFU", ".1%"), ("peak_memory_gib", "mem", ".1f"),
                            ("rewards/accuracies", "reward acc", ".3f"), ("rewards/margins", "margin", ".3f")):
        if key in logs:
            parts.append(f"{label} {logs[key]:{fmt}}" + (" GiB" if key == "peak_memory_gib" else ""))
    for key, value in logs.items():
        if key.startswith("moe/"):
            parts.append(f"{key[4:]} {value:.4f}")
        elif key.startswith("mtp_loss"):
            parts.append(f"{key.replace('_', ' ')} {value:.4f}")
    if logs.get("skipped_steps"):
        parts.append(f"skipped {int(logs['skipped_steps'])} step(s) with inf/nan")
    return " | ".join(parts)


class ProgressCallback(TrainerCallback):
    """The bar (where there is a terminal) and one line per logging step (always), on rank 0."""

    def __init__(self) -> None:
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            # disable=None: no bar where stderr is no terminal (CI, nohup), where it would print a line per update;
            # disable_tqdm: no bar at all. The log lines come either way.
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True,
                            disable=True if args.disable_tqdm else None)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs:
            self.bar.write(format_logs(state.global_step, state.max_steps, logs))  # prints too when disabled

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
