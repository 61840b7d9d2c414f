"""Hub ids in ``model_name_or_path`` resolve to a local folder exactly as LLaMA-Factory's default path does.

LLaMA-Factory hands hub ids to ``transformers`` (local Hugging Face cache, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``,
``cache_dir``, ``model_revision``, ``hf_hub_token``) or downloads them from ModelScope / openMind
(``USE_MODELSCOPE_HUB`` / ``USE_OPENMIND_HUB``). We read safetensors slices ourselves, so we need the folder:
the launcher resolves (downloading if needed) once per node before any worker starts, and passes the
folder to its workers in ``LLAMAFACTORY_MCA_RESOLVED``, so every rank reads the same snapshot.

A value that cannot be a hub id (an absolute or ``./`` path, three parts) is a folder that does not exist, and is
reported as one: huggingface_hub would answer that the repo id is malformed, which points the wrong way. A value
that can be both (``org/name``) says where it was looked for: the local folder, the cache, the hub.
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


def is_hub_id(name: str) -> bool:
    """``name`` or ``org/name`` as the hub spells ids (a path such as ``/a/b``, ``./a`` or ``a/b/c`` is none)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _no_folder(name: str, field: str) -> str:
    """Where ``name`` points on this machine, and the nearest folder that exists on the way (a typo shows there)."""
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.exists(path):
        return f"{field}={name!r} is a file ({path}), not a folder; point it at the folder that holds the model."
    parent = os.path.dirname(path)
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return (f"{field}={name!r}: the folder {path} does not exist (the nearest existing folder is {parent}). Point it "
            "at a model folder, or give a hub id (org/name).")


def resolve_model(name: str, model_args: Any = None, field: str = "model_name_or_path") -> str:
    """A local folder for ``name`` (a folder or a hub id), downloading it if the hub settings allow; ``field`` is
    how the user gave it (a recipe key, a command's flag), for the message when it cannot be found."""
    if is_local(name):
        return os.path.expanduser(name)
    if not is_hub_id(name):
        raise UserError(_no_folder(name, field))
    known = _resolved().get(name)
    if known and os.path.isdir(known):
        return known
    path = _download(name, model_args, field)
    remember(name, path)
    return path


def _download(name: str, model_args: Any, field: str) -> str:
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
            raise UserError(f"{field}={name!r} is no local folder ({os.path.abspath(name)} does not exist) and could "
                            f"not be downloaded from {hub} ({err}). Check the id and your network, or point {field} "
                            "at a local folder.") from err
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(name, revision=revision, cache_dir=cache_dir,
                                 token=getattr(model_args, "hf_hub_token", None), allow_patterns=ALLOW_PATTERNS)
    except LocalEntryNotFoundError as err:
        cache = cache_dir or constants.HF_HUB_CACHE
        why = "HF_HUB_OFFLINE=1 forbids downloading it" if constants.HF_HUB_OFFLINE else \
            f"downloading it from {constants.ENDPOINT} failed"
        raise UserError(f"{field}={name!r} (revision {revision!r}) is neither a local folder ({os.path.abspath(name)} "
                        f"does not exist) nor in the Hugging Face cache ({cache}), and {why}. Download it first (hf "
                        f"download {name}), set cache_dir to the cache that holds it, or point {field} at a local "
                        "folder.") from err
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise UserError(f"{field}={name!r} is no local folder ({os.path.abspath(name)} does not exist) nor a model "
                        f"on {constants.ENDPOINT} (or it is gated and needs a token: hf_hub_token or `hf auth "
                        "login`).") from err
    except RevisionNotFoundError as err:
        raise UserError(f"model_revision={revision!r} does not exist for {name!r}.") from err

