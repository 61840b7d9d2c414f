"""Command lines of the bridge: merge (dist checkpoint → HF) and convert (HF → dist checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import torch

from ..checkpoints import MCA_CONFIG_NAME
from ..errors import UserError, user_errors


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
            raise UserError(f"--{name}={given} contradicts the checkpoint, which was written with {name}="
                            f"{saved[name]}. Drop the flag: the merge reads the layout from the checkpoint.")


def _merge_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron_merge.py", description="Merge a llamafactory_mca checkpoint (any parallel layout) into Hugging "
        "Face weights, on CPU in one process, one tensor group at a time.",
        epilog="LLaMA-Factory's merge flags (the parallel sizes, --moe_grouped_gemm) are accepted so existing "
        "commands keep working; the layout is read from the checkpoint, and a flag that contradicts it is an error.")
    parser.add_argument("paths", nargs="*", metavar="PATH", help="checkpoint_path output_path, positionally")
    parser.add_argument("--checkpoint_path", help="an output_dir/checkpoint-N folder written by training")
    parser.add_argument("--output_path", help="where the Hugging Face model goes (written only when complete)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="write bfloat16 weights (default: as trained)")
    precision.add_argument("--fp16", action="store_true", help="write float16 weights")
    for name in _LAYOUT_FLAGS:
        parser.add_argument(f"--{name}", type=int, metavar="N", help="accepted for LLaMA-Factory commands; must match "
                            "the checkpoint")
    parser.add_argument("--moe_grouped_gemm", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="?",
                        const=True, default=None, metavar="BOOL", help="accepted; must match the checkpoint")
    parser.add_argument("--convert_model_max_length", type=int, metavar="N",
                        help="set max_position_embeddings in the written config.json")
    parser.add_argument("--max_shard_size_gb", type=float, default=5.0, metavar="GB",
                        help="largest safetensors file (default 5)")
    return parser


def merge_main(argv: list[str] | None = None) -> int:
    from ..log import setup_logging
    from ..quiet import quiet_third_party
    from .export import export_hf

    setup_logging()
    quiet_third_party()
    parser = _merge_parser()
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint_path or (args.paths[0] if args.paths else None)
    output = args.output_path or (args.paths[1] if len(args.paths) > 1 else None)
    if not checkpoint or not output:
        parser.error("give --checkpoint_path and --output_path")
    with user_errors():
        _check_flags_against_checkpoint(args, checkpoint)
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        result = export_hf(checkpoint, output, dtype=dtype, max_shard_bytes=int(args.max_shard_size_gb * 1024**3))
    if args.convert_model_max_length:
        path = os.path.join(output, "config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        config["max_position_embeddings"] = args.convert_model_max_length
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    size, seconds = result["bytes"] / 2**20, result["seconds"]
    print(f"Hugging Face weights written to {output} ({size:,.1f} MiB in {seconds:.1f} s; "
          f"{', '.join(result['side_files']) or 'no tokenizer files'})")
    return 0


def _convert_parser() -> argparse.ArgumentParser:
    from ..args import MegatronArguments

    parser = argparse.ArgumentParser(
        prog="llamafactory-mca convert", description="Pre-shard a Hugging Face model into a Megatron dist checkpoint "
        "that training loads directly (model_name_or_path: OUTPUT_PATH), in the layout given. Starts the processes "
        "the layout needs itself.", epilog="Other Megatron keys (see `llamafactory-mca train --help`) are accepted as "
        "--key value.")
    parser.add_argument("--hf_path", required=True, help="a Hugging Face model folder or hub id")
    parser.add_argument("--output_path", required=True, help="where the dist checkpoint goes")
    parser.add_argument("--bf16", action="store_true", help="store bfloat16 weights")
    parser.add_argument("--fp16", action="store_true", help="store float16 weights")
    helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(MegatronArguments)}
    for name in _LAYOUT_FLAGS:
        parser.add_argument(f"--{name}", type=int, metavar="N", help=helps[name])
    return parser


def convert_main(argv: list[str]) -> int:
    """``llamafactory-mca convert --hf_path DIR --output_path DIR [layout flags]``."""
    from transformers import HfArgumentParser

    from ..args import MegatronArguments
    from ..hub import resolve_model
    from ..parallel import ParallelLayout, check_layout, min_world_size
    from ..quiet import quiet_third_party
    from .auto import AutoConfig

    quiet_third_party()
    known, rest = _convert_parser().parse_known_args(argv)
    with user_errors(also=(ValueError,)):
        (margs, unknown) = HfArgumentParser(MegatronArguments).parse_args_into_dataclasses(
            args=rest, return_remaining_strings=True)
        if unknown:
            raise UserError(f"unknown arguments {unknown}; see llamafactory-mca convert --help.")
        for name in _LAYOUT_FLAGS:
            if getattr(known, name) is not None:
                setattr(margs, name, getattr(known, name))
        margs.__post_init__()
        margs.bf16, margs.fp16 = known.bf16, known.fp16
        needed = min_world_size(margs.tensor_model_parallel_size, margs.pipeline_model_parallel_size,
                                margs.context_parallel_size, margs.expert_model_parallel_size,
                                margs.expert_tensor_parallel_size or 1)
        world = int(os.environ.get("WORLD_SIZE", needed))
        hf_path = resolve_model(known.hf_path)
        config = AutoConfig.from_pretrained(hf_path, margs)
        check_layout(config, ParallelLayout.from_args(margs, world_size=world),
                     margs.pipeline_model_parallel_layout is not None)
        if "WORLD_SIZE" in os.environ or needed == 1:
            return _convert(hf_path, known.output_path, margs, config)
    command = [sys.executable, "-m", "llamafactory_mca.launch", "--nproc_per_node", str(needed), "-m",
               "llamafactory_mca.cli", "convert", *argv]
    return subprocess.run(command, check=False).returncode


def _convert(hf_path: str, output: str, margs, config) -> int:
    """One rank's part (every check already passed in convert_main)."""
    import shutil

    from megatron.core import dist_checkpointing

    from .. import parallel
    from ..checkpoints import DIST_DIR
    from .auto import AutoModel
    from .hf_io import copy_side_files

    layout = parallel.ParallelLayout.from_args(margs)
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
        shutil.copy(os.path.join(hf_path, "config.json"), os.path.join(output, "config.json"))
        print(f"Megatron dist checkpoint written to {output} ({MCA_CONFIG_NAME}, {DIST_DIR}/)")
    torch.distributed.barrier()
    parallel.destroy()
    return 0
