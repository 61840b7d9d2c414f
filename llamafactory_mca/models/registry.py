"""The registry of model families, keyed by Hugging Face ``model_type`` and filled by a decorator.

It imports no family, so a family module can register itself without an import loop; ``families``
imports every family and looks them up (``families.get_family``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from .families.base import Family


FAMILIES: dict[str, Family] = {}


def register(model_type: str) -> Callable[[type[Family]], type[Family]]:
    """Class decorator: one instance of the family serves ``model_type``."""

    def wrap(cls: type[Family]) -> type[Family]:
        if model_type in FAMILIES:
            raise ValueError(f"model_type {model_type!r} registered twice")
        instance = cls()
        instance.model_type = model_type
        FAMILIES[model_type] = instance
        return cls

    return wrap
