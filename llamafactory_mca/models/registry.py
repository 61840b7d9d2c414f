"""One registry of model families, keyed by Hugging Face ``model_type`` and filled by a decorator.

A family is data: how its HF config maps to Megatron's TransformerConfig and which ops map its
weights (``mapping.py``). Sharding, file IO and export are generic and live elsewhere.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

from ..errors import UserError
from .config import McaConfig
from .mapping import Op


class Family:
    """Base of every family; subclasses state only what differs from their parent."""

    model_type: str = ""

    def check(self, hf: Any) -> None:
        """Refuse what we cannot honour, so a run never silently trains a different model."""

    def config_from_hf(self, hf: Any) -> McaConfig:
        raise NotImplementedError

    def weights(self, config: McaConfig) -> list[Op]:
        raise NotImplementedError

    def ignored_hf_keys(self) -> tuple[str, ...]:
        """HF checkpoint keys that carry no weights (e.g. saved rotary buffers)."""
        return ("model.layers.*.self_attn.rotary_emb.inv_freq",)


FAMILIES: dict[str, Family] = {}


def register(model_type: str) -> Callable[[type[Family]], type[Family]]:
    def wrap(cls: type[Family]) -> type[Family]:
        if model_type in FAMILIES:
            raise ValueError(f"model_type {model_type!r} registered twice")
        instance = cls()
        instance.model_type = model_type
        FAMILIES[model_type] = instance
        return cls

    return wrap


def get_family(model_type: str) -> Family:
    from . import families  # noqa: F401  (registers every family)

    if model_type not in FAMILIES:
        raise UserError(f"model_type {model_type!r} is not supported by llamafactory_mca; supported: "
                         f"{', '.join(sorted(FAMILIES))}.")
    return FAMILIES[model_type]
