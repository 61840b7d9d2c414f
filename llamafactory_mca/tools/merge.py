"""``llamafactory-mca merge`` (and ``scripts/megatron_merge.py``): a checkpoint of ours → Hugging Face weights.

Runs on CPU in one plain process (no GPU, no torchrun), one tensor group at a time, so a model larger than host
memory merges. The work is ``models.export.export_hf``; call ``merge`` to do it in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from ..checkpoints import LAYOUT_KEYS, is_adapter_checkpoint, read_layout, verify_contents
from ..errors import UserError, user_errors
from ..hub import resolve_model
from ..log import setup_logging
from ..models.export import export_hf
from ..models.lora.peft_io import export_adapter, merge_adapter, read_adapter_config
from ..quiet import quiet_third_party
from . import flags


def _check_flags_against_checkpoint(args: argparse.Namespace, checkpoint: str) -> None:
    saved = read_layout(checkpoint)
    for name in (*LAYOUT_KEYS, "moe_grouped_gemm"):
        given = getattr(args, name, None)
        if given is not None and saved.get(name) is not None and given != saved[name]:
            raise UserError(f"--{name}={given} contradicts the checkpoint, which was written with {name}="
                            f"{saved[name]}. Drop the flag: the merge reads the layout from the checkpoint.")


def merge(checkpoint: str, output: str, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 1024**3,
          model_max_length: int | None = None, merge_lora: bool = False, base_model: str | None = None) -> dict:
    """Write ``output`` (HF safetensors, config.json, tokenizer files) from ``checkpoint``; returns bytes, seconds
    and the side files copied. Nothing is written unless the checkpoint verifies, and ``output`` appears whole.
    A LoRA run's checkpoint gives its peft adapter, or with ``merge_lora`` the base model with it merged in."""
    verify_contents(checkpoint)  # a flipped byte would merge into wrong weights without a word
    if is_adapter_checkpoint(checkpoint):
        return _merge_adapter_checkpoint(checkpoint, output, dtype, merge_lora, base_model)
    result = export_hf(checkpoint, output, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if model_max_length:
        path = os.path.join(output, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config["max_position_embeddings"] = model_max_length
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    return result


def _merge_adapter_checkpoint(checkpoint: str, output: str, dtype: torch.dtype | None, merge_lora: bool,
                              base_model: str | None) -> dict:
    start = time.perf_counter()
    if not merge_lora:
        copied = export_adapter(checkpoint, output, dtype)["side_files"]
        return {"bytes": _folder_bytes(output), "seconds": time.perf_counter() - start, "side_files": copied,
                "adapter": True}
    base = base_model or read_adapter_config(checkpoint).get("base_model_name_or_path")
    if not base or not os.path.isdir(base):
        if not base:
            raise UserError(f"{checkpoint} is a LoRA checkpoint whose base model is not recorded; give --base_model.")
        base = resolve_model(base, None, field="--base_model" if base_model else "base_model_name_or_path")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(output)) or ".") as adapter:
        export_adapter(checkpoint, adapter)
        copied = merge_adapter(adapter, base, output, dtype)
    return {"bytes": _folder_bytes(output), "seconds": time.perf_counter() - start, "side_files": copied,
            "merged_lora": True}


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def main(argv: list[str] | None = None, prog: str = "llamafactory-mca merge") -> int:
    setup_logging()
    quiet_third_party()
    parser = flags.merge(prog)
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint_path or (args.paths[0] if args.paths else None)
    output = args.output_path or (args.paths[1] if len(args.paths) > 1 else None)
    if not checkpoint or not output:
        parser.error("give --checkpoint_path and --output_path")
    with user_errors():
        _check_flags_against_checkpoint(args, checkpoint)
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        result = merge(checkpoint, output, dtype, int(args.max_shard_size_gb * 1024**3), args.convert_model_max_length,
                       args.merge_lora, args.base_model)
    size, seconds = result["bytes"] / 2**20, result["seconds"]
    what = "A peft LoRA adapter" if result.get("adapter") else \
        "Hugging Face weights with the LoRA adapter merged in" if result.get("merged_lora") else "Hugging Face weights"
    print(f"{what} written to {output} ({size:,.1f} MiB in {seconds:.1f} s; "
          f"{', '.join(result['side_files']) or 'no tokenizer files'})")
    return 0
