"""``llamafactory-mca``: train, convert, demo, version.

``train x.yaml`` is exactly ``USE_MCA=1 llamafactory-cli train x.yaml`` (LLaMA-Factory's launcher,
parser and dispatch), for people who would rather not set the variable.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


USAGE = """usage: llamafactory-mca <command> [args]

  train x.yaml [key=value ...]   train with Megatron-Core (same as USE_MCA=1 llamafactory-cli train x.yaml)
  convert --hf_path DIR --output_path DIR [--tensor_model_parallel_size N ...]
                                 pre-shard a Hugging Face checkpoint into a Megatron dist checkpoint
  demo [--output_dir DIR]        build a tiny Qwen3-style model, train, merge, generate (CPU or GPU)
  version                        versions of this package, LLaMA-Factory, Megatron-Core, torch, CUDA
"""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    import torch

    from . import __version__
    from .compat import has_flash_attn, has_transformer_engine

    return {
        "llamafactory-mca": __version__,
        "llamafactory": _version("llamafactory"),
        "megatron-core": _version("megatron-core"),
        "transformers": _version("transformers"),
        "torch": torch.__version__,
        "CUDA": f"{torch.version.cuda} ({torch.cuda.device_count()} GPUs visible)" if torch.cuda.is_available()
        else f"{torch.version.cuda or 'none'} (no GPU visible: CPU mode)",
        "transformer-engine": _version("transformer-engine") if has_transformer_engine() else "absent",
        "flash-attn": _version("flash-attn") if has_flash_attn() else "absent",
    }


def train(argv: list[str]) -> int:
    os.environ["USE_MCA"] = "1"
    from .plugin import install

    install()
    from llamafactory.cli import main as lf_main

    sys.argv = ["llamafactory-cli", "train", *argv]
    lf_main()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "help"
    if command == "train":
        return train(argv)
    if command == "version":
        for name, value in versions().items():
            print(f"{name:20s} {value}")
        return 0
    if command == "convert":
        from .models.convert import convert_main

        return convert_main(argv)
    if command == "demo":
        from .demo import demo_main

        return demo_main(argv)
    print(USAGE)
    return 0 if command in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
