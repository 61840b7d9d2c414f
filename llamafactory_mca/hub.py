"""Hub ids in ``model_name_or_path`` resolve to a local folder exactly as LLaMA-Factory's default path does.

LLaMA-Factory hands hub ids to ``transformers`` (local Hugging Face cache, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``,
``cache_dir``, ``model_revision``, ``hf_hub_token``) or downloads them from ModelScope / openMind
(``USE_MODELSCOPE_HUB`` / ``USE_OPENMIND_HUB``). We read safetensors slices ourselves, so we need the folder:
the launcher resolves (downloading if needed) once per node before any worker starts, and passes the
folder to its workers in ``LLAMAFACTORY_MCA_RESOLVED``, so every rank reads the same snapshot.
"""

from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace
from typing import Any

from .errors import UserError

RESOLVED_ENV = "LLAMAFACTORY_MCA_RESOLVED"
# What training needs from a model repository: weights, configs, tokenizer, chat template, remote code.
ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def _resolved() -> dict[str, str]:
    try:
        return json.loads(os.environ.get(RESOLVED_ENV, "{}"))
    except json.JSONDecodeError:
        return {}


def remember(name: str, path: str) -> None:
    """Record a resolution for this process and the workers it starts."""
    resolved = _resolved()
    resolved[name] = path
    os.environ[RESOLVED_ENV] = json.dumps(resolved)


def is_local(name: str) -> bool:
    return os.path.isdir(os.path.expanduser(name))


def resolve_model(name: str, model_args: Any = None) -> str:
    """A local folder for ``name`` (a folder or a hub id), downloading it if the hub settings allow."""
    if is_local(name):
        return os.path.expanduser(name)
    known = _resolved().get(name)
    if known and os.path.isdir(known):
        return known
    path = _download(name, model_args)
    remember(name, path)
    return path


def _download(name: str, model_args: Any) -> str:
    from llamafactory.extras.misc import use_modelscope, use_openmind

    cache_dir = getattr(model_args, "cache_dir", None)
    revision = getattr(model_args, "model_revision", None) or "main"
    if use_modelscope() or use_openmind():
        from llamafactory.extras.misc import try_download_model_from_other_hub

        hub = "ModelScope" if use_modelscope() else "openMind"
        args = copy.copy(model_args) if model_args is not None else SimpleNamespace(
            cache_dir=None, model_revision="main", ms_hub_token=None)
        args.model_name_or_path = name
        try:
            return try_download_model_from_other_hub(args)
        except Exception as err:
            raise UserError(f"model_name_or_path={name!r} could not be downloaded from {hub} ({err}). Check the id "
                            "and your network, or point model_name_or_path at a local folder.") from err
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, \
        RevisionNotFoundError

    try:
        return snapshot_download(name, revision=revision, cache_dir=cache_dir,
                                 token=getattr(model_args, "hf_hub_token", None), allow_patterns=ALLOW_PATTERNS)
    except LocalEntryNotFoundError as err:
        cache = cache_dir or constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE else \
            f"downloading it from {constants.ENDPOINT} failed"
        raise UserError(f"model_name_or_path={name!r} (revision {revision!r}) is neither a local folder nor in the "
                        f"Hugging Face cache ({cache}), and {why}. Download it first (hf download {name}), set "
                        "cache_dir to the cache that holds it, or point model_name_or_path at a local folder.") \
            from err
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise UserError(f"model_name_or_path={name!r}: no such model on {constants.ENDPOINT}, or it is gated and "
                        "needs a token (hf_hub_token or `hf auth login`).") from err
    except RevisionNotFoundError as err:
        raise UserError(f"model_revision={revision!r} does not exist for {name!r}.") from err

