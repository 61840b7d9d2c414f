"""Does the installed set work together? ``llamafactory-mca version`` answers with one line per problem.

The package index moves under us: on 2026-11-23 it began serving torch 2.15.0 (CUDA 13.2) while the newest
torchaudio is 2.11.0 (CUDA 13.0), and torchaudio refuses to load beside a torch built for another CUDA;
LLaMA-Factory imports torchaudio at start-up, so every run fails. Reporting versions is not enough: this
imports what a run imports and turns a failure into the packages, their versions and the fix.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re

from .. import __version__
from ..compat import has_flash_attn, has_transformer_engine


TORCH_SET = ("torch", "torchvision", "torchaudio")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pinned() -> dict[str, str]:
    """The versions this package pins (requirements/*.txt, as installed), e.g. {"torch": "2.14.1"}."""
    found = {}
    for requirement in importlib.metadata.requires("llamafactory-mca") or []:
        match = re.match(r"^([A-Za-z0-9_.-]+)\s*==\s*([^;\s]+)", requirement)
        if match:
            found[match.group(1).lower()] = match.group(2)
    return found


def _build(version: str) -> str | None:
    """The local build tag of a torch-family version: "cu130", "cpu", or None (NGC and source builds differ)."""
    match = re.search(r"\+(cu\d+|cpu|rocm[\d.]+|xpu)$", version)
    return match.group(1) if match else None


def torch_set_problems(installed: dict[str, str | None]) -> list[str]:
    """``installed``: {"torch": "2.15.0+cu132", ...} (module ``__version__`` strings; None when absent)."""
    problems = []
    missing = [name for name in TORCH_SET if not installed.get(name)]
    if missing:
        problems.append(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; LLaMA-Factory "
                        f"imports them. Fix: {fix_command()}")
    builds = {name: _build(installed[name]) for name in TORCH_SET if installed.get(name)}
    torch_build = builds.get("torch")
    for name in ("torchvision", "torchaudio"):
        build = builds.get(name)
        if torch_build and build and build != torch_build:
            problems.append(f"torch {installed['torch']} and {name} {installed[name]} were built for different CUDA "
                            f"versions ({torch_build} vs {build}); {name} refuses to load, and LLaMA-Factory imports "
                            f"it at start-up. Fix: {fix_command()}")
    return problems


def fix_command() -> str:
    pins = pinned()
    names = [f"{name}=={pins[name]}" for name in TORCH_SET if name in pins]
    return f"pip install {' '.join(names)} (the set CI tests)" if names else \
        "install torch, torchvision and torchaudio built for the same CUDA version"


def _module_version(name: str) -> str | None:
    """The package's own ``__version__`` from its ``version.py`` (it carries the CUDA tag, which the wheel's
    metadata does not), read as text: importing a mismatched torchaudio is what fails."""
    spec = importlib.util.find_spec(name)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "version.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
            if match:
                return match.group(1)
    return _version(name)


def check_installation() -> list[str]:
    """Every problem, one line each; empty when a run's imports work."""
    problems = torch_set_problems({name: _module_version(name) for name in TORCH_SET})
    if problems:
        return problems  # the imports below would only fail for the same reason
    for module, what in (("llamafactory.data", "LLaMA-Factory's data modules"),
                         ("llamafactory.train.tuner", "LLaMA-Factory's training modules"),
                         ("megatron.core.models.gpt", "Megatron-Core")):
        try:
            importlib.import_module(module)
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            problems.append(f"importing {what} ({module}) fails: {first}. Reinstall the tested set: "
                            "pip install -e . (from a checkout) or pip install llamafactory-mca.")
    return problems


def versions() -> dict[str, str]:
    import torch  # here: `llamafactory-mca` starts without torch; only `version` asks it

    def show(dist: str) -> str:
        return _version(dist) or "not installed"

    return {
        "llamafactory-mca": __version__,
        "llamafactory": show("llamafactory"),
        "megatron-core": show("megatron-core"),
        "transformers": show("transformers"),
        "torch": torch.__version__,
        "torchvision": _module_version("torchvision") or "not installed",
        "torchaudio": _module_version("torchaudio") or "not installed",
        "CUDA": f"{torch.version.cuda} ({torch.cuda.device_count()} GPUs visible)" if torch.cuda.is_available()
        else f"{torch.version.cuda or 'none'} (no GPU visible: CPU mode)",
        "transformer-engine": show("transformer-engine") if has_transformer_engine() else "absent",
        "flash-attn": show("flash-attn") if has_flash_attn() else "absent",
    }
