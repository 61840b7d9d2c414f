"""``llamafactory-mca convert``: pre-shard a Hugging Face model into a folder of ours (a Megatron dist checkpoint)
that training loads directly. Starts the processes the layout needs itself; ``convert_rank`` is one rank's part.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch
from transformers import HfArgumentParser

from .. import parallel
from ..args import MegatronArguments
from ..checkpoints import DIST_DIR, LAYOUT_KEYS, MCA_CONFIG_NAME, SideFiles, verify_contents, write_folder
from ..errors import UserError, user_errors
from ..hub import resolve_model
from ..models import value_head
from ..models.auto import AutoConfig, AutoModel
from ..parallel import ParallelLayout, check_layout, min_world_size
from ..plan import check_model_files
from ..quiet import quiet_third_party
from . import flags


def main(argv: list[str]) -> int:
    """``llamafactory-mca convert --hf_path DIR --output_path DIR [layout flags]``."""
    quiet_third_party()
    known, rest = flags.convert().parse_known_args(argv)
    with user_errors(also=(ValueError,)):
        (margs, unknown) = HfArgumentParser(MegatronArguments).parse_args_into_dataclasses(
            args=rest, return_remaining_strings=True)
        if unknown:
            raise UserError(f"unknown arguments {unknown}; see llamafactory-mca convert --help.")
        for name in LAYOUT_KEYS:
            if getattr(known, name) is not None:
                setattr(margs, name, getattr(known, name))
        margs.__post_init__()
        margs.bf16, margs.fp16 = known.bf16, known.fp16
        needed = min_world_size(margs)
        world = int(os.environ.get("WORLD_SIZE", needed))
        hf_path = resolve_model(known.hf_path, field="--hf_path")
        config = AutoConfig.from_pretrained(hf_path, margs)
        check_model_files(hf_path)
        verify_contents(hf_path)  # our exports carry checksums
        check_layout(config, ParallelLayout.from_args(margs, world_size=world),
                     margs.pipeline_model_parallel_layout is not None, margs.sequence_parallel)
        if "WORLD_SIZE" in os.environ or needed == 1:
            return convert_rank(hf_path, known.output_path, margs)
    command = [sys.executable, "-m", "llamafactory_mca.launch.torchrun", "--nproc_per_node", str(needed), "-m",
               "llamafactory_mca.launch.cli", "convert", *argv]
    return subprocess.run(command, check=False).returncode


def convert_rank(hf_path: str, output: str, margs: Any) -> int:
    """One rank's part: build this rank's chunks from the HF weights and write them as a folder of ours."""
    layout = parallel.ParallelLayout.from_args(margs)
    parallel.initialize(layout)
    # a reward model's value head (value_head.safetensors beside the weights) comes along, for rm runs to start from
    model = AutoModel.from_pretrained(hf_path, margs, value_head=value_head.read_file(hf_path) is not None)
    write_folder(output, model.sharded_state_dict(), SideFiles(model.config, layout, hf_source=hf_path))
    if torch.distributed.get_rank() == 0:
        print(f"Megatron dist checkpoint written to {output} ({MCA_CONFIG_NAME}, {DIST_DIR}/)")
    parallel.destroy()
    return 0
