"""Command lines of the bridge: merge (dist checkpoint → HF) and convert (HF → dist checkpoint)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import torch

from .config import MCA_CONFIG_NAME


logger = logging.getLogger(__name__)

LAYOUT_NAME = "mca_layout.json"  # the layout a checkpoint was written in (informational; loads reshard)
_LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size")


def write_layout(directory: str, layout, grouped_experts: bool | None) -> None:
    record = {name: getattr(layout, attr) for name, attr in zip(_LAYOUT_FLAGS, ("tp", "pp", "vpp", "ep", "etp", "cp"))}
    record["moe_grouped_gemm"] = grouped_experts
    with open(os.path.join(directory, LAYOUT_NAME), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)


def _check_flags_against_checkpoint(args: argparse.Namespace, checkpoint: str) -> None:
    path = os.path.join(checkpoint, LAYOUT_NAME)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    for name in (*_LAYOUT_FLAGS, "moe_grouped_gemm"):
        given = getattr(args, name, None)
        if given is not None and saved.get(name) is not None and given != saved[name]:
            raise ValueError(f"--{name}={given} contradicts the checkpoint, which was written with {name}="
                             f"{saved[name]}. Drop the flag: the merge reads the layout from the checkpoint.")


def _merge_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Merge a llamafactory_mca checkpoint into Hugging Face weights.")
    parser.add_argument("paths", nargs="*", help="[checkpoint_path output_path] (LLaMA-Factory style)")
    parser.add_argument("--checkpoint_path")
    parser.add_argument("--output_path")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true")
    precision.add_argument("--fp16", action="store_true")
    for name in _LAYOUT_FLAGS:
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--moe_grouped_gemm", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="?",
                        const=True, default=None)
    parser.add_argument("--convert_model_max_length", type=int, help="max_position_embeddings in config.json")
    parser.add_argument("--max_shard_size_gb", type=float, default=5.0)
    return parser


def merge_main(argv: list[str] | None = None) -> int:
    from .export import export_hf

    from ..log import setup_logging

    setup_logging()
    args = _merge_parser().parse_args(argv)
    checkpoint = args.checkpoint_path or (args.paths[0] if args.paths else None)
    output = args.output_path or (args.paths[1] if len(args.paths) > 1 else None)
    if not checkpoint or not output:
        _merge_parser().error("give --checkpoint_path and --output_path")
    _check_flags_against_checkpoint(args, checkpoint)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    export_hf(checkpoint, output, dtype=dtype, max_shard_bytes=int(args.max_shard_size_gb * 1024**3))
    if args.convert_model_max_length:
        path = os.path.join(output, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config["max_position_embeddings"] = args.convert_model_max_length
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    print(f"Hugging Face checkpoint written to {output}")
    return 0


def convert_main(argv: list[str]) -> int:
    """``llamafactory-mca convert --hf_path DIR --output_path DIR [layout flags]``: a dist checkpoint that
    training loads directly (``model_name_or_path: DIR``). Starts the processes the layout needs itself."""
    from transformers import HfArgumentParser

    from ..args import MegatronArguments

    parser = argparse.ArgumentParser(description="Convert a Hugging Face model into a Megatron dist checkpoint.")
    parser.add_argument("--hf_path", required=True)
    parser.add_argument("--output_path", required=True)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    known, rest = parser.parse_known_args(argv)
    (margs,) = HfArgumentParser(MegatronArguments).parse_args_into_dataclasses(args=rest)
    margs.bf16, margs.fp16 = known.bf16, known.fp16
    from ..parallel import min_world_size

    needed = min_world_size(margs.tensor_model_parallel_size, margs.pipeline_model_parallel_size,
                            margs.context_parallel_size, margs.expert_model_parallel_size,
                            margs.expert_tensor_parallel_size or 1)
    if "WORLD_SIZE" not in os.environ and needed > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(needed),
                   "-m", "llamafactory_mca.cli", "convert", *argv]
        return subprocess.run(command, check=False).returncode
    return _convert(known.hf_path, known.output_path, margs)


def _convert(hf_path: str, output: str, margs) -> int:
    from megatron.core import dist_checkpointing

    from .. import parallel
    from .auto import DIST_DIR, AutoConfig, AutoModel
    from .hf_io import copy_side_files

    layout = parallel.ParallelLayout.from_args(margs)
    config = AutoConfig.from_pretrained(hf_path, margs)
    from .auto import check_layout

    check_layout(config, layout, margs.pipeline_model_parallel_layout is not None)
    parallel.initialize(layout)
    model = AutoModel.from_pretrained(hf_path, margs)
    dist_dir = os.path.join(output, DIST_DIR)
    if torch.distributed.get_rank() == 0:
        os.makedirs(dist_dir, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), dist_dir)
    if torch.distributed.get_rank() == 0:
        config.save_pretrained(output)
        write_layout(output, layout, None)
        copy_side_files(hf_path, output)
        import shutil

        shutil.copy(os.path.join(hf_path, "config.json"), os.path.join(output, "config.json"))
        print(f"Megatron dist checkpoint written to {output} ({MCA_CONFIG_NAME}, {DIST_DIR}/)")
    torch.distributed.barrier()
    parallel.destroy()
    return 0
