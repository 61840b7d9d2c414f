"""LLaMA-Factory's ``finetuning_type: freeze`` on Megatron modules: the same layers and modules train."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..errors import UserError
from .config import McaConfig
from .families import get_family


# LLaMA-Factory names the HF modules of a decoder layer and of the model; these are their Megatron names.
LAYER_MODULES = {"self_attn": "self_attention", "linear_attn": "self_attention", "mlp": "mlp",
                 "input_layernorm": "input_layernorm",
                 "post_attention_layernorm": "pre_mlp_layernorm", "block_sparse_moe": "mlp"}
EXTRA_MODULES = {"embed_tokens": "embedding.", "lm_head": "output_layer.", "norm": "decoder.final_layernorm."}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.([a-z_]+)\.")


def trainable_layer_ids(num_layers: int, trainable_layers: int, use_llama_pro: bool = False) -> list[int]:
    """LLaMA-Factory's rule: the last n layers (n > 0), the first -n (n < 0), or every (L/n)-th (LLaMA Pro)."""
    if use_llama_pro:
        if num_layers % trainable_layers:
            raise UserError(f"num_layers={num_layers} is not divisible by freeze_trainable_layers="
                             f"{trainable_layers}.")
        stride = num_layers // trainable_layers
        return list(range(stride - 1, num_layers + stride - 1, stride))
    if trainable_layers > 0:
        return list(range(max(0, num_layers - trainable_layers), num_layers))
    return list(range(min(-trainable_layers, num_layers)))


def apply_freeze(model: Any, finetuning_args: Any) -> int:
    """Freeze everything except the chosen layers/modules; returns the number of trainable parameters here."""
    config = model.config
    layers = set(trainable_layer_ids(config.num_layers, finetuning_args.freeze_trainable_layers,
                                     getattr(finetuning_args, "use_llama_pro", False)))
    modules = list(finetuning_args.freeze_trainable_modules)
    unknown = [m for m in modules if m != "all" and m not in LAYER_MODULES]
    extras = list(finetuning_args.freeze_extra_modules or [])
    unknown += [m for m in extras if m not in EXTRA_MODULES]
    if unknown:
        raise UserError(f"freeze modules {unknown} are not known; choose layer modules from "
                         f"{sorted(LAYER_MODULES)} (or all) and extra modules from {sorted(EXTRA_MODULES)}.")
    wanted = {LAYER_MODULES[m] for m in modules if m != "all"}
    trainable = 0
    for chunk in model.chunks:
        numbers = {f"decoder.layers.{i}.": layer.layer_number - 1 for i, layer in enumerate(chunk.decoder.layers)}
        for name, param in chunk.named_parameters():
            train = any(name.startswith(EXTRA_MODULES[m]) for m in extras)
            match = _LAYER.match(name)
            if match and numbers.get(f"decoder.layers.{match.group(1)}.") in layers:
                train = train or "all" in modules or match.group(2) in wanted
            train = train and not getattr(param, "no_gradient", False)  # GLM-5's indexer: transformers' no_grad
            param.requires_grad_(train)
            trainable += param.numel() if train else 0
    return trainable


def vision_frozen(config: McaConfig, freeze_vision_tower: bool, freeze_projector: bool) -> Callable[[str], bool]:
    """Whether a tower parameter (by its own name, ``X`` of our ``vision.X``) is frozen: LLaMA-Factory's rule, by its
    own table of each VL model's module names (``COMPOSITE_MODELS``), a key anywhere in the checkpoint's name."""
    # here: LLaMA-Factory's model utilities import seconds of modules; only VL models need the table
    from llamafactory.model.model_utils.visual import COMPOSITE_MODELS

    names = COMPOSITE_MODELS.get(config.hf_model_type)
    if names is None:
        return lambda name: False
    tower_prefix = get_family(config).vision.tower_prefix  # "visual." or "model.visual."
    keys = ((names.vision_model_keys if freeze_vision_tower else [])
            + (names.projector_keys if freeze_projector else []))
    return lambda name: any(key in tower_prefix + name for key in keys)


def apply_multimodal_freeze(model: Any, finetuning_args: Any) -> int:
    """``freeze_vision_tower``, ``freeze_multi_modal_projector`` and ``freeze_language_model`` as LLaMA-Factory's
    default path applies them (``vision_frozen``). Returns the number of parameters frozen here."""
    if not get_family(model.config).vision:
        return 0
    tower_frozen = vision_frozen(model.config, finetuning_args.freeze_vision_tower,
                                 finetuning_args.freeze_multi_modal_projector)
    frozen = 0
    for chunk in model.chunks:
        for name, param in chunk.named_parameters():
            if name.startswith("vision."):
                freeze = tower_frozen(name[len("vision."):])
            else:
                freeze = bool(finetuning_args.freeze_language_model)
            if freeze:
                param.requires_grad_(False)
                frozen += param.numel()
    return frozen
