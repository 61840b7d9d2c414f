"""The registry of model families, keyed by Hugging Face ``model_type`` and filled by a decorator.

A vision-language model type that transformers builds over several decoders (InternVL: Qwen3's or gpt-oss's, as its
``text_config.model_type`` says) registers one family per decoder under its ``model_type``: the weights, refusals and
layers are the decoder's, so the decoder picks the family; ``families.get_family`` makes that choice, in one place.

It imports no family, so a family module can register itself without an import loop; ``families``
imports every family and looks them up (``families.get_family``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from .families.base import Family


# model_type -> {the text config's model_type the family is declared over (None: whatever it is) -> the family}
FAMILIES: dict[str, dict[str | None, Family]] = {}


def register(model_type: str, decoder: str | None = None) -> Callable[[type[Family]], type[Family]]:
    """Class decorator: one instance of the family serves ``model_type``; with ``decoder``, only the models of that
    type whose text config is a ``decoder`` (the first declared also answers for the type by its name alone)."""

    def wrap(cls: type[Family]) -> type[Family]:
        by_decoder = FAMILIES.setdefault(model_type, {})
        if by_decoder and (decoder is None or None in by_decoder or decoder in by_decoder):
            raise ValueError(f"model_type {model_type!r} registered twice" + (f" (decoder {decoder!r})" if decoder
                                                                                else ""))
        instance = cls()
        instance.model_type, instance.decoder = model_type, decoder
        by_decoder[decoder] = instance
        return cls

    return wrap
