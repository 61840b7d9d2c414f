"""``llamafactory-mca``: train, plan, merge, convert, verify, demo, version — the front ends; the work is in the
library.

``train x.yaml`` is exactly ``USE_MCA=1 llamafactory-cli train x.yaml`` (LLaMA-Factory's launcher, parser and
dispatch, with our preflight), for people who would rather not set the variable. Everything here imports
lazily, so ``--help`` answers at once.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from importlib.metadata import version as installed

from ..errors import user_errors
from ..quiet import quiet_third_party
from ..tools.flags import PARSERS
from .health import check_installation, versions
from .plugin import install, quiet_ctrl_c_while_importing, refuse_when_disabled, skip_the_final_collection
from .preflight import train_help


COMMANDS = ("train", "plan", "merge", "convert", "verify", "demo", "version", "help")
FRONT_ENDS = {"plan": (".plan_command", "main"), "merge": ("..tools.merge", "main"),
              "convert": ("..tools.convert", "main"), "verify": ("..tools.verify", "main"),
              "demo": ("..tools.demo", "demo_main")}
USAGE = """usage: llamafactory-mca <command> [args]

  train RECIPE.yaml [key=value ...]  train with Megatron-Core (same as USE_MCA=1 llamafactory-cli train ...)
  plan RECIPE.yaml [key=value ...] [--gpus N] [--gpu-memory GIB] [--json]
                                     memory per GPU before a run; with --gpus, the layouts that fit
  merge --checkpoint_path DIR --output_path DIR [--bf16]
                                     a checkpoint (any layout) -> Hugging Face weights, on CPU
  convert --hf_path DIR --output_path DIR [--tensor_model_parallel_size N ...]
                                     pre-shard a Hugging Face model into a Megatron dist checkpoint
  verify PATH [PATH ...]             a checkpoint, output_dir or exported model against its checksums
  demo [--output_dir DIR]            build a tiny Qwen3-style model, train, merge, generate (CPU or GPU)
  version                            versions of the installed set, and whether they work together

`llamafactory-mca <command> --help` says more; scripts/megatron_merge.py is `merge` under the name LLaMA-Factory
users know."""


def train(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(train_help())
        return 0
    os.environ["USE_MCA"] = "1"
    install()
    quiet_ctrl_c_while_importing()
    from llamafactory.cli import main as lf_main  # here: after install(), which LLaMA-Factory's import needs

    sys.argv = ["llamafactory-cli", "train", *argv]
    lf_main()
    return 0


VERSION_USAGE = """usage: llamafactory-mca version

Prints the installed torch, torchvision, torchaudio, LLaMA-Factory, Megatron-Core, transformers, peft, ... and
checks that they work together (imports them: seconds), one line per problem with its fix; exit code 1 if any.
`llamafactory-mca --version` prints this package's version alone, at once."""


def version(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(VERSION_USAGE)
        return 0
    quiet_third_party()
    for name, value in versions().items():
        print(f"{name:20s} {value}")
    problems = check_installation()
    for line in problems:
        print(f"[llamafactory_mca] problem: {line}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "help"
    skip_the_final_collection()
    if command in ("train", "demo") and not any(a in ("-h", "--help") for a in argv):
        with user_errors():
            refuse_when_disabled(command)
    if command == "train":
        return train(argv)
    if command == "version":
        return version(argv)
    if command in FRONT_ENDS and any(a in ("-h", "--help") for a in argv):  # from the flags alone, at once
        print(PARSERS[command]().format_help())
        return 0
    if command in FRONT_ENDS:  # imported when asked for: the others answer at once
        quiet_third_party()  # before Megatron-Core's import-time warnings
        module, function = FRONT_ENDS[command]
        return getattr(importlib.import_module(module, __package__), function)(argv)
    if command in ("help", "-h", "--help"):
        print(USAGE)
        return 0
    if command in ("--version", "-V"):  # the installed package; `version` checks the whole set (seconds)
        print(f"llamafactory-mca {installed('llamafactory-mca')}")
        return 0
    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"llamafactory-mca: unknown command {command!r}{hint}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
