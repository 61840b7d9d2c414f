"""The flags of the commands beside training (plan, merge, convert, verify, demo), in argparse alone.

Kept apart from the commands' work so that ``--help`` and a mistyped flag answer at once: the commands import
torch, transformers or LLaMA-Factory (seconds), this module nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..args import LAYOUT_KEYS, MegatronArguments


PLAN_USAGE = "llamafactory-mca plan RECIPE.yaml [key=value ...] [--gpus N] [--gpu-memory GIB] [--json]"


def plan() -> argparse.ArgumentParser:
    """Known flags only: the recipe and its key=value overrides are the rest (LLaMA-Factory's reading)."""
    parser = argparse.ArgumentParser(
        prog="llamafactory-mca plan", usage=PLAN_USAGE, add_help=False,
        description="What the recipe needs per GPU (weights, gradients, optimizer states, activations, logits) in its "
        "own layout, and whether it fits. The recipe is read as training reads it, but only the model's config.json "
        "is opened: no weights, no GPU, no process group.")
    parser.add_argument("--gpus", type=int, default=None, metavar="N",
                        help="also search the layouts of the same global batch that fit N GPUs, best first, with the "
                        "keys to paste")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="each GPU's memory (default: the visible GPU's, else the recipe's Hardware line)")
    parser.add_argument("--json", action="store_true", help="one JSON object as the last line")
    parser.add_argument("--top", type=int, default=5, metavar="K", help="layouts listed with --gpus (default 5)")
    return parser


def merge(prog: str = "llamafactory-mca merge") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Merge a llamafactory_mca checkpoint (any parallel layout) into Hugging "
        "Face weights, on CPU in one process, one tensor group at a time.",
        epilog="LLaMA-Factory's merge flags (the parallel sizes, --moe_grouped_gemm) are accepted so existing "
        "commands keep working; the layout is read from the checkpoint, and a flag that contradicts it is an error.")
    parser.add_argument("paths", nargs="*", metavar="PATH", help="checkpoint_path output_path, positionally")
    parser.add_argument("--checkpoint_path", help="an output_dir/checkpoint-N folder written by training")
    parser.add_argument("--output_path", help="where the Hugging Face model goes (written only when complete)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="write bfloat16 weights (default: as trained)")
    precision.add_argument("--fp16", action="store_true", help="write float16 weights")
    for name in LAYOUT_KEYS:
        parser.add_argument(f"--{name}", type=int, metavar="N", help="accepted for LLaMA-Factory commands; must match "
                            "the checkpoint")
    parser.add_argument("--moe_grouped_gemm", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="?",
                        const=True, default=None, metavar="BOOL", help="accepted; must match the checkpoint")
    parser.add_argument("--convert_model_max_length", type=int, metavar="N",
                        help="set max_position_embeddings in the written config.json")
    parser.add_argument("--max_shard_size_gb", type=float, default=5.0, metavar="GB",
                        help="largest safetensors file (default 5)")
    parser.add_argument("--merge_lora", action="store_true", help="a LoRA run's checkpoint: write the base model with "
                        "the adapter merged in (default: the peft adapter)")
    parser.add_argument("--base_model", help="a LoRA run's base model (default: the one it trained on)")
    return parser


def convert() -> argparse.ArgumentParser:
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
    for name in LAYOUT_KEYS:
        parser.add_argument(f"--{name}", type=int, metavar="N", help=helps[name])
    return parser


def verify() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamafactory-mca verify", usage="llamafactory-mca verify PATH [PATH ...]",
        description="Is a folder intact, before a merge, a resume or a copy elsewhere: a checkpoint of ours against "
        "the checksums written with it, a run's output_dir checkpoint by checkpoint, a Hugging Face folder's "
        "safetensors headers against its files and index. The first bad file ends the command with its name.")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a checkpoint, a run's output_dir or a Hugging Face model folder")
    return parser


def demo() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamafactory-mca demo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The whole path on whatever machine this is, in about a minute: builds a tiny Qwen3-style model "
        "and a tokenizer\nfor the dataset in examples/data, trains it with USE_MCA=1 llamafactory-cli train (two CPU "
        "processes without\na GPU, all GPUs with them), merges the last checkpoint and lets transformers answer a "
        "question with it.")
    parser.add_argument("--output_dir", default="demo_output",
                        help="where the model, recipe, checkpoints, merged weights and loss curve go (default: "
                             "%(default)s, in the current folder)")
    parser.add_argument("--steps", type=int, default=40,
                        help="training steps (default: %(default)s; enough for the model to learn its answer)")
    return parser


PARSERS = {"plan": plan, "merge": merge, "convert": convert, "verify": verify, "demo": demo}
