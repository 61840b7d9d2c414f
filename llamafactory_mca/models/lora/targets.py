"""Which modules LoRA adapts: LLaMA-Factory's lora_* keys read once (``LoraSettings``, the refusals), the targets
resolved the way peft resolves them on the Hugging Face model (built on the meta device), and each target laid out on
Megatron's fused linears with the weight table's own ops (``plan_targets``). Planning needs no Megatron model, so the
launcher's checks, the plan and the adapter's export all read it; ``layers.py`` builds the adapters from it."""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import UserError
from ..families import get_family
from ..mapping import GroupedRows, Op, PerLayer, WeightTable


EXPERTS_WORD = "experts"  # lora_target word for the routed experts (peft target_parameters)
EXPERT_PIECES = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
REFUSED = {  # LLaMA-Factory options this backend cannot honour, by name
    "use_dora": "DoRA", "pissa_init": "PiSSA", "pissa_convert": "PiSSA", "loraplus_lr_ratio": "LoRA+",
    "use_galore": "GaLore", "use_apollo": "APOLLO", "use_badam": "BAdam",
}


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all",)
    additional: tuple[str, ...] = ()
    rslora: bool = False
    seed: int = 42
    experts: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "experts", EXPERTS_WORD in self.targets)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def from_args(cls, finetuning_args: Any, seed: int = 42) -> LoraSettings:
        targets = tuple(t.strip() for t in (finetuning_args.lora_target or ["all"]) if t.strip())
        return cls(rank=int(finetuning_args.lora_rank), alpha=float(finetuning_args.lora_alpha or
                                                                      finetuning_args.lora_rank * 2),
                   dropout=float(finetuning_args.lora_dropout), targets=targets,
                   additional=tuple(finetuning_args.additional_target or ()), rslora=bool(finetuning_args.use_rslora),
                   seed=seed)

    @classmethod
    def from_peft(cls, adapter_config: dict, seed: int = 42) -> LoraSettings:
        """The settings of a saved peft adapter (``adapter_config.json``). LLaMA-Factory's default path writes a
        vision-language model's targets as the full names of the modules it adapted (``patch_target_modules``: the
        tower left out); peft matches a module by its last name either way, so those read as their last names, and
        a module the file then lacks in some layer is refused by name when its tensors load (``load_adapter``)."""
        modules = adapter_config.get("target_modules") or []
        if isinstance(modules, str):
            raise UserError(f"target_modules={modules!r} in the adapter's adapter_config.json is a regular "
                            "expression, which llamafactory_mca does not read: save the adapter with a list of "
                            "module names (LLaMA-Factory's lora_target), or unset USE_MCA to use LLaMA-Factory's "
                            "default trainer.")
        targets = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in modules))
        if adapter_config.get("target_parameters"):
            targets.append(EXPERTS_WORD)
        return cls(rank=int(adapter_config["r"]), alpha=float(adapter_config["lora_alpha"]),
                   dropout=float(adapter_config.get("lora_dropout") or 0.0), targets=tuple(targets),
                   additional=tuple(adapter_config.get("modules_to_save") or ()),
                   rslora=bool(adapter_config.get("use_rslora")), seed=seed)


def check_lora_request(finetuning_args: Any) -> None:
    """Refuse, by name, the LoRA variants and optimizers we cannot honour (before any worker starts)."""
    for key, name in REFUSED.items():
        if getattr(finetuning_args, key, None):
            raise UserError(f"{key}={getattr(finetuning_args, key)!r} ({name}) is not supported with USE_MCA=1: "
                            f"LoRA here is plain LoRA (optionally rsLoRA). Remove {key}, or unset USE_MCA to use "
                            "LLaMA-Factory's default trainer.")
    if finetuning_args.lora_rank < 1:
        raise UserError(f"lora_rank={finetuning_args.lora_rank} must be at least 1.")
    targets = [t.strip() for t in (finetuning_args.lora_target or [])]
    if EXPERTS_WORD in targets and finetuning_args.lora_dropout:
        raise UserError(f"lora_dropout={finetuning_args.lora_dropout} with lora_target '{EXPERTS_WORD}': peft's "
                        "expert adapters (target_parameters) take no dropout, so the saved adapter could not be "
                        "loaded. Set lora_dropout: 0.")


# ---- which Megatron linears, which pieces ---------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One HF module's adapter on a Megatron linear: its name in the linear (``q_proj``) and its shape."""

    name: str
    out_features: int
    in_features: int
    hf_module: str  # the module path in the HF model (layer index ``*``), for peft's names


@dataclass(frozen=True)
class TargetLinear:
    """A Megatron linear (canonical name pattern, layer ``*``) and the adapters on it."""

    mca: str  # e.g. decoder.layers.*.self_attention.linear_qkv
    op: Op | None  # the weight op laying the pieces' rows out (None for experts)
    pieces: tuple[Piece, ...]
    experts: bool = False
    # where the linear differs between layers (mapping.PerLayer: Gemma 4's full-attention layers), each layer's target
    # (None: no adapter there); ``pieces`` then lists every layer's
    layers: tuple[TargetLinear | None, ...] | None = None

    def at(self, layer: int) -> TargetLinear | None:
        """The target in decoder layer ``layer``."""
        return self if self.layers is None else self.layers[layer]


@functools.cache
def _meta_hf_model(hf_config_json: str) -> torch.nn.Module:
    """The HF model on the meta device: its module names and shapes are what peft and LLaMA-Factory see."""
    # here: transformers takes seconds to import; this module's other helpers (planning LoRA) do without it
    import transformers

    hf_config = json.loads(hf_config_json)
    config = transformers.AutoConfig.for_model(**hf_config)
    auto = transformers.AutoModelForImageTextToText if "vision_config" in hf_config else \
        transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def meta_hf_model(hf_config: dict) -> torch.nn.Module:
    return _meta_hf_model(json.dumps(hf_config, sort_keys=True))


def _vision_keys(model: torch.nn.Module) -> list[str]:
    # here: LLaMA-Factory's model utilities import seconds of modules; only VL models need the table
    from llamafactory.model.model_utils.visual import COMPOSITE_MODELS

    names = COMPOSITE_MODELS.get(getattr(model.config, "model_type", None))
    return list(names.vision_model_keys) + list(names.projector_keys) if names else []


def resolve_targets(hf_config: dict, settings: LoraSettings, freeze_vision_tower: bool = True) -> list[str]:
    """The HF module names ``lora_target`` selects, ``all`` exactly as LLaMA-Factory's default path expands it."""
    names = [t for t in settings.targets if t != EXPERTS_WORD]
    if "all" in names:
        # here: LLaMA-Factory, only for lora_target all
        from llamafactory.model.model_utils.misc import find_all_linear_modules

        untrained = get_family(hf_config).no_gradient
        names = [n for n in names if n != "all"] + sorted(
            set(find_all_linear_modules(meta_hf_model(hf_config), freeze_vision_tower)) - set(untrained))
    return list(dict.fromkeys(names))


def _text_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The decoder layers' modules by path with ``*`` for the layer, each from the first layer that has it (models
    mixing dense and MoE layers have some modules only in later layers), the vision tower and projector left out."""
    vision = _vision_keys(model)
    found: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        match = re.search(r"\.layers\.\d+\.", name)
        if match and not any(key in name for key in vision):
            found.setdefault(f"{name[:match.start()]}.layers.*.{name[match.end():]}", module)
    return found


# Megatron's linears an adapter can sit on: attention (multi-latent attention's five projections among them, each one
# HF module; the gated delta-rule layer's in_proj, fused from two HF modules or four, and out_proj) and the dense or
# shared-expert MLP; and weights that are not linears (``layers.LoraFoldedMixin``): the shared expert's gate, and a
# router whose HF projection is a linear (Gemma 4's)
SHARED_GATE = ".mlp.shared_experts.gate"
ROUTER = ".mlp.router"
_ADAPTABLE = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
              "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "in_proj", "out_proj")
# linears outside the decoder layers: Gemma 4's projection of the input embeddings into the per-layer inputs
MODEL_LINEARS = ("per_layer_inputs.linear_proj",)


def plan_targets(hf_config: dict, table: WeightTable, settings: LoraSettings,
                 freeze_vision_tower: bool = True) -> list[TargetLinear]:
    """Map the selected HF modules onto Megatron's linears through the weight table; refuse what has no home."""
    wanted = resolve_targets(hf_config, settings, freeze_vision_tower)
    modules = _text_modules(meta_hf_model(hf_config))
    by_suffix = {name.split(".layers.*.", 1)[1]: name for name in modules}
    found: set[str] = set()
    homes: set[str] = set()  # every HF module an adapter could go on
    targets = []

    def pieces_of(op: Op, layer: int | None) -> tuple[Piece, ...]:
        """The adapters on ``op``'s linear: of the first layer that has each module, or of ``layer``'s."""
        pieces = []
        for hf_name in op.hf:
            module = hf_name[: -len(".weight")]
            short = module.rsplit(".", 1)[-1]
            homes.add(short)
            if short not in wanted:
                continue
            path = by_suffix.get(module.split(".layers.*.", 1)[-1])
            if path is None:
                continue
            module = modules[path] if layer is None else layered.get(path.replace(".*.", f".{layer}.", 1))
            if module is None:
                continue
            pieces.append(Piece(short, *module.weight.shape, path))
            found.add(short)
        return tuple(pieces)

    layered = dict(meta_hf_model(hf_config).named_modules())
    num_layers = (hf_config.get("text_config") or hf_config)["num_hidden_layers"]
    for op in table.ops:
        if op.mca.endswith(".weight") and op.mca[: -len(".weight")] in MODEL_LINEARS:
            module = op.hf[0][: -len(".weight")]
            short = module.rsplit(".", 1)[-1]
            homes.add(short)
            if short in wanted and module in layered:
                targets.append(TargetLinear(op.mca[: -len(".weight")], op,
                                            (Piece(short, *layered[module].weight.shape, module),)))
                found.add(short)
            continue
        if ".local_experts." in op.mca or not op.mca.startswith("decoder.layers."):
            continue
        if op.mca.endswith(SHARED_GATE + "_weight"):
            linear = op.mca[: -len("_weight")]
        elif op.mca.endswith(ROUTER + ".weight"):
            linear = op.mca[: -len(".weight")]
        elif op.mca.endswith(".weight") and op.mca[: -len(".weight")].rsplit(".", 1)[-1] in _ADAPTABLE:
            linear = op.mca[: -len(".weight")]
        else:
            continue
        if isinstance(op, PerLayer):
            per_layer = tuple(TargetLinear(linear, layer_op, pieces) if (pieces := pieces_of(layer_op, i)) else None
                              for i, layer_op in enumerate(op.layers))
            every = tuple({p.name: p for t in per_layer if t for p in t.pieces}.values())
            if every:
                targets.append(TargetLinear(linear, op, every, layers=per_layer))
            continue
        pieces = pieces_of(op, None)
        shapes = {pieces_of(op, i) for i in range(num_layers)} - {()}
        if len(shapes) > 1:  # its shape differs between layers (Gemma 4's full-attention o_proj): one per layer
            per_layer = tuple(TargetLinear(linear, op, layer) if (layer := pieces_of(op, i)) else None
                              for i in range(num_layers))
            targets.append(TargetLinear(linear, op, pieces, layers=per_layer))
        elif pieces:
            targets.append(TargetLinear(linear, op, pieces))
    folded = [p.name for t in targets if t.mca.endswith((SHARED_GATE, ROUTER)) for p in t.pieces]
    if folded and settings.dropout:
        raise UserError(f"lora_dropout={settings.dropout} with LoRA on {folded}: its adapter is folded into a weight "
                        "that is not a linear here (a gate or a router), which leaves no place for dropout. Set "
                        "lora_dropout: 0, or leave it out of lora_target.")
    if settings.experts:
        targets += _expert_targets(hf_config, modules)
    missing = [name for name in wanted if name not in found]
    if missing:
        what = (f"lora_target: all selects, as LLaMA-Factory expands it for this model, {missing}, which "
                "llamafactory_mca cannot put LoRA on" if "all" in settings.targets else
                f"lora_target {missing} names modules llamafactory_mca cannot put LoRA on for this model")
        raise UserError(f"{what} (LoRA goes on the attention and MLP projections: {', '.join(sorted(homes))}, and on "
                        f"the routed experts with the word '{EXPERTS_WORD}'). Set lora_target to a list of those.")
    if not targets:
        raise UserError(f"lora_target={list(settings.targets)} selects no module of this model.")
    return targets


def _expert_targets(hf_config: dict, modules: dict[str, torch.nn.Module]) -> list[TargetLinear]:
    experts = [(name, m) for name, m in modules.items() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
               and getattr(m, "gate_up_proj").dim() == 3]
    if not experts:
        raise UserError(f"lora_target '{EXPERTS_WORD}': this model has no routed experts.")
    path, module = experts[0]
    targets = []
    for linear, piece in EXPERT_PIECES.items():
        _, out_features, in_features = getattr(module, piece).shape  # transformers' in-memory [E, out, in]
        targets.append(TargetLinear(f"decoder.layers.*.mlp.experts.{linear}", None,
                                    (Piece(piece, out_features, in_features, f"{path}.{piece}"),), experts=True))
    return targets


# ---- the adapters --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraPlan:
    """The adapter a LoRA run trains, planned once per process (``peft_io.plan_lora``): its settings and the linears
    it goes on, checked against the layout."""

    settings: LoraSettings
    targets: tuple[TargetLinear, ...]
    resume: str | None = None  # the adapter folder training continues (the last of adapter_name_or_path), if any


def refuse_split_pieces(targets: list[TargetLinear], tensor_parallel: int) -> None:
    """HF modules of a fused linear that hold several of its row groups each (Qwen3.5's flat ``in_proj_qkv``: the q,
    k and v of every head in turn): a tensor-parallel rank's rows of such a module are not one block of it, so
    their adapter's B cannot be split over TP ranks as each adapter is (a dist checkpoint's adapter is peft's)."""
    split = set()
    for target in (t for every in targets for t in (every.layers or (every,)) if t):
        if isinstance(target.op, GroupedRows):
            indices = [i for i, _ in target.op.parts]
            held = {target.op.hf[i][: -len(".weight")].rsplit(".", 1)[-1] for i in indices if indices.count(i) > 1}
            split |= held & {p.name for p in target.pieces}
    if split and tensor_parallel > 1:
        raise UserError(f"LoRA on {sorted(split)} needs tensor_model_parallel_size: 1 (it is {tensor_parallel}): "
                        "each holds the q, k and v of every head in turn, so a rank's rows are not one block of its "
                        "adapter. Leave them out of lora_target, or use tensor_model_parallel_size: 1.")


def refuse_split_experts(settings: LoraSettings, expert_tensor_parallel: int) -> None:
    """Expert adapters are laid out per whole expert: each expert's weights must sit whole on one rank."""
    if settings.experts and expert_tensor_parallel > 1:
        raise UserError(f"LoRA on the experts needs expert_tensor_parallel_size: 1 (each expert whole on its rank); "
                        f"it is {expert_tensor_parallel}. Set expert_tensor_parallel_size: 1.")
