"""Every supported family, imported explicitly so the registry is complete once this package is imported."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import UserError
from ..config import McaConfig
from ..registry import FAMILIES
from . import (  # noqa: F401
    deepseek_v3,
    gemma3,
    gemma4,
    glm4_moe,
    glm4v_moe,
    glm_moe_dsa,
    gpt_oss,
    internvl,
    llama,
    minimax_m2,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen2_vl,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)
from .base import Family, refuse


if TYPE_CHECKING:
    from transformers import PretrainedConfig


def get_family(model: McaConfig | PretrainedConfig | Mapping[str, Any] | str) -> Family:
    """The family serving a model (our McaConfig, an HF config or its dict, or a ``model_type`` alone): by its
    ``model_type`` and, where that type is declared over several decoders (InternVL), by its text config's
    ``model_type`` too, refusing any other decoder in one line that names those declared. A name alone there gets
    the first declared (InternVL on Qwen3): enough to ask about the parts they share (the tower), and its
    ``config_from_hf`` refuses another decoder's config."""
    model_type, decoder = _model_types(model)
    if model_type not in FAMILIES:
        raise UserError(f"model_type {model_type!r} is not supported by llamafactory_mca; supported: "
                         f"{', '.join(sorted(FAMILIES))}.")
    by_decoder = FAMILIES[model_type]
    if decoder is None or None in by_decoder:
        return next(iter(by_decoder.values()))
    if decoder not in by_decoder:
        refuse(model_type, f"a {decoder} decoder (text_config.model_type)",
               f"Supported: {', '.join(sorted(by_decoder))}.")
    return by_decoder[decoder]


def _model_types(model: Any) -> tuple[str, str | None]:
    """(model_type, the text config's model_type or None) of a name, our McaConfig, or an HF config or its dict."""
    if isinstance(model, str):
        return model, None
    if isinstance(model, McaConfig):
        return model.hf_model_type, (model.hf_config.get("text_config") or {}).get("model_type")
    if isinstance(model, Mapping):
        return model["model_type"], (model.get("text_config") or {}).get("model_type")
    return model.model_type, getattr(getattr(model, "text_config", None), "model_type", None)
