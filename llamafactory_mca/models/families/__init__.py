"""Every supported family, imported explicitly so the registry is complete once this package is imported."""

from ...errors import UserError
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
from .base import Family


def get_family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise UserError(f"model_type {model_type!r} is not supported by llamafactory_mca; supported: "
                         f"{', '.join(sorted(FAMILIES))}.")
    return FAMILIES[model_type]
