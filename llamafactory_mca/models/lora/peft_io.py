"""LoRA adapters in peft's format: written from our dist checkpoints, read into a model, merged into full weights.

peft names an adapter by the HF module it sits on (``base_model.model.<module>.lora_A.weight``); our adapter tensors
already hold exactly those tensors (``layers.py``), so dense adapters move as they are. Experts are peft's
``target_parameters`` on transformers' fused ``experts.gate_up_proj`` [E, out, in] / ``experts.down_proj``: peft keeps
one [r·E, out] / [in, r·E] pair per parameter, whose roles are our B and A transposed (``experts_to_peft``), and
nests the second-wrapped parameter's pair under ``base_layer.``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import transformers
from megatron.core import parallel_state as ps
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file, save_file

from ...checkpoints import ADAPTER_CONFIG_NAME as ADAPTER_CONFIG
from ...checkpoints import config_file, dist_checkpoint_dir, verify_checkpoint
from ...checkpoints.dist_reader import DistCheckpointReader
from ...checkpoints.hf_io import copy_side_files, move_into
from ...errors import UserError
from ..config import McaConfig
from ..export import read_tensor
from ..families import get_family
from ..freeze import EXTRA_MODULES
from ..loading import dims_for, local_targets
from ..mapping import DictSource
from ..value_head import V_HEAD_SAFE_WEIGHTS_NAME
from ..value_head import write_file as write_value_head
from .layers import LoraGroupedExpertsMixin, apply_lora, lora_modules, merge_lora
from .targets import (
    EXPERT_PIECES,
    LoraPlan,
    LoraSettings,
    TargetLinear,
    meta_hf_model,
    plan_targets,
    refuse_split_experts,
    refuse_split_pieces,
)


ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def is_adapter_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def read_adapter_config(path: str) -> dict:
    with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise UserError(f"{path} holds a {config.get('peft_type')} adapter; USE_MCA=1 continues LoRA adapters only.")
    for key in ("use_dora",):
        if config.get(key):
            raise UserError(f"{path} is a DoRA adapter ({key}=true), which USE_MCA=1 does not train.")
    return config


def peft_config(settings: LoraSettings, targets: list[TargetLinear], base_model: str | None) -> dict:
    """adapter_config.json as peft writes it for the same adapter."""
    modules = sorted({p.name for t in targets if not t.experts for p in t.pieces})
    params = [f"experts.{t.pieces[0].name}" for t in targets if t.experts]
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=modules or None, target_parameters=params or None,
                        modules_to_save=list(settings.additional) or None, use_rslora=settings.rslora,
                        task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


def experts_to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our per-expert A [E, r, in] and B [E, out, r] as peft's lora_A [r·E, out] and lora_B [in, r·E] (its delta is
    einsum("o r e, e r i -> e i o") over A viewed [E, r, out] and B viewed [in, r, E])."""
    experts, rank, inputs = a.shape
    return b.transpose(1, 2).reshape(experts * rank, -1).contiguous(), a.permute(2, 1, 0).reshape(inputs, -1)


def experts_from_peft(lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank = lora_a.shape[0] // experts
    return lora_b.view(-1, rank, experts).permute(2, 1, 0).contiguous(), \
        lora_a.view(experts, rank, -1).transpose(1, 2).contiguous()


def peft_key(target: TargetLinear, piece_name: str, layer: int, which: str) -> str:
    piece = next(p for p in target.pieces if p.name == piece_name)
    path = piece.hf_module.replace("*", str(layer))
    if not target.experts:
        return f"{PEFT_PREFIX}{path}.lora_{which}.weight"
    module, param = path.rsplit(".", 1)
    order = list(EXPERT_PIECES.values())
    nested = "base_layer." * (len(order) - 1 - order.index(param))  # peft wraps gate_up_proj first
    return f"{PEFT_PREFIX}{module}.{nested}lora_{which}.weight"


def _in_memory_name(hf_name: str, names: set[str]) -> str:
    """A checkpoint name as the HF model in memory calls it (Qwen2-VL files say ``model.x``, memory
    ``model.language_model.x``)."""
    if hf_name in names:
        return hf_name
    tail = hf_name.split(".", 1)[-1]
    found = [n for n in names if n.endswith("." + tail) and "visual" not in n]
    return found[0] if len(found) == 1 else hf_name


def _additional_ops(config: Any, settings: LoraSettings) -> list:
    prefixes = tuple(EXTRA_MODULES[m] for m in settings.additional)
    table = get_family(config).weight_table(config)
    return [op for op in table.ops if prefixes and op.mca.startswith(prefixes) and op.export]


def _targets(config: Any, settings: LoraSettings, freeze_vision_tower: bool = True) -> list[TargetLinear]:
    return plan_targets(config.hf_config, get_family(config).weight_table(config), settings,
                        freeze_vision_tower)


def plan_lora(config: Any, finetuning_args: Any, adapters: list[str], expert_tensor_parallel: int,
              tensor_parallel: int = 1, seed: int = 42) -> LoraPlan:
    """The adapter this run trains, with the checks made once: the adapters to continue are peft LoRA folders, the
    targets exist on this model, expert adapters have whole experts."""
    for path in adapters:
        if not is_adapter_folder(path):
            raise UserError(f"adapter_name_or_path={path!r} is not a peft adapter folder (no {ADAPTER_CONFIG}).")
        read_adapter_config(path)
    resume = adapters[-1] if adapters and not finetuning_args.create_new_adapter else None
    settings = LoraSettings.from_peft(read_adapter_config(resume), seed) if resume else \
        LoraSettings.from_args(finetuning_args, seed)
    targets = _targets(config, settings, finetuning_args.freeze_vision_tower)
    refuse_split_pieces(targets, tensor_parallel)
    refuse_split_experts(settings, expert_tensor_parallel)
    return LoraPlan(settings, tuple(targets), resume)


def export_adapter(checkpoint: str, output: str, dtype: torch.dtype | None = None) -> dict:
    """A checkpoint of a LoRA run → ``output``/adapter_model.safetensors + adapter_config.json (+ tokenizer)."""
    verify_checkpoint(checkpoint)
    config = McaConfig.from_json_file(config_file(checkpoint))
    adapter_config = read_adapter_config(checkpoint)
    settings = LoraSettings.from_peft(adapter_config)
    reader = DistCheckpointReader(dist_checkpoint_dir(checkpoint))
    tensors: dict[str, torch.Tensor] = {}
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    for every in _targets(config, settings):
        layered = every.mca.startswith("decoder.layers.")  # or one linear outside them (targets.MODEL_LINEARS)
        for layer in range(config.num_layers if layered else 1):
            target = every.at(layer)  # (where the linear differs between layers, this layer's)
            if target is None or not config.holds(f"{target.mca}.weight", layer):  # e.g. a dense layer's MLP
                continue
            index = (layer,) if layered else ()
            for piece in target.pieces:
                if target.experts:
                    linear = target.mca.rsplit(".", 1)[-1]
                    pattern = f"decoder.layers.*.mlp.experts.local_experts.*.{linear}.lora_%s.{piece.name}"
                    pair = experts_to_peft(read_tensor(reader, pattern % "A", (layer,), config),
                                           read_tensor(reader, pattern % "B", (layer,), config))
                else:
                    a, b = (read_tensor(reader, f"{target.mca}.lora_{w}.{piece.name}", index, config) for w in "AB")
                    pair = a, target.op.rows_as_hf(b)  # B's rows as the weight's (mapping.Op)
                for which, tensor in zip("AB", pair):
                    tensors[peft_key(target, piece.name, layer, which)] = cast(tensor).contiguous()
    names = {n for n, _ in meta_hf_model(config.hf_config).named_parameters()}
    dims = dims_for(config, 1)
    for op in _additional_ops(config, settings):
        for hf_name, tensor in zip(op.hf, op.to_hf(read_tensor(reader, op.mca, (), config), dims)):
            tensors[PEFT_PREFIX + _in_memory_name(hf_name, names)] = cast(tensor).contiguous()
    staging = f"{os.path.abspath(output)}.tmp-{os.getpid()}"
    try:
        os.makedirs(staging)
        save_file(tensors, os.path.join(staging, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        write_value_head(reader, staging, dtype)  # a reward model's, beside its adapter as LLaMA-Factory writes it
        with open(os.path.join(staging, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(adapter_config, f, indent=2, sort_keys=True)
        copied = copy_side_files(checkpoint, staging)  # tokenizer files; no config.json: peft reads the base's
        move_into(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"tensors": len(tensors), "side_files": copied}


def _read_adapter_tensors(path: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if os.path.isfile(file):
        return load_file(file)
    legacy = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise UserError(f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}: the adapter is incomplete.")


@torch.no_grad()
def load_adapter(model: Any, path: str) -> None:
    """A peft adapter's tensors into the adapters ``apply_lora`` put on this rank's chunks (each rank takes its
    slices), and its ``modules_to_save`` into the base."""
    tensors = _read_adapter_tensors(path)
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in tensors:
            raise UserError(f"the adapter at {path} has no tensor {key}: it was trained for another model or with "
                            "other lora_target modules.")
        used.add(key)
        return tensors[key]

    for module in lora_modules(model):
        if isinstance(module, LoraGroupedExpertsMixin):
            layer = int(module.lora_name.split(".")[2])
            n, first = module.num_local_experts, module.lora_first_expert
            for target in module.lora_targets:
                linear, piece = target.mca.rsplit(".", 1)[-1], target.pieces[0].name
                total = take(peft_key(target, piece, layer, "A")).shape[0] // module.lora_A[linear].shape[1]
                a, b = experts_from_peft(take(peft_key(target, piece, layer, "A")),
                                         take(peft_key(target, piece, layer, "B")), total)
                module.lora_A[linear].copy_(a[first:first + n])
                module.lora_B[linear].copy_(b[first:first + n])
            continue
        target, parts = module.lora_target, module.lora_name.split(".")
        layer = int(parts[2]) if module.lora_name.startswith("decoder.layers.") else 0  # (targets.MODEL_LINEARS)
        tp, rank = module.tp_group.size(), module.tp_group.rank()
        for piece in target.pieces:
            if target.experts:
                expert, total = int(parts[5]), model.config.num_experts
                a_all, b_all = experts_from_peft(take(peft_key(target, piece.name, layer, "A")),
                                                 take(peft_key(target, piece.name, layer, "B")), total)
                a, b = a_all[expert], b_all[expert]
            else:
                a, b = take(peft_key(target, piece.name, layer, "A")), take(peft_key(target, piece.name, layer, "B"))
                b = target.op.rows_as_ours(b)  # B's rows as the weight's
            if module.lora_column:
                b = b.chunk(tp, dim=0)[rank]
            elif not getattr(module, "lora_replicated", False):
                a = a.chunk(tp, dim=1)[rank]
            module.lora_A[piece.name].copy_(a)
            module.lora_B[piece.name].copy_(b)
    _load_additional(model, tensors, used)


def _load_additional(model: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> None:
    """``modules_to_save`` tensors (embed_tokens, lm_head, norm) into the base parameters they replace."""
    extra = {k[len(PEFT_PREFIX):]: v for k, v in tensors.items() if k not in used and ".lora_" not in k}
    if not extra:
        return
    config = model.config
    table = get_family(config).weight_table(config)
    dims = dims_for(config, ps.get_tensor_model_parallel_world_size())
    names = set(extra)
    for chunk in model.chunks:
        for target in local_targets(chunk, config.num_experts):
            if ".lora_A." in target.canonical or ".lora_B." in target.canonical:
                continue
            op, hf_names = table.lookup(target.canonical)
            found = [_in_memory_name(n, names) for n in hf_names]
            if all(n in extra for n in found):
                src = DictSource({n: extra[m] for n, m in zip(hf_names, found)})
                target.assign(op.load(src, hf_names, target.shard, dims))


def setup_lora(model: Any, lora: LoraPlan, adapters: list[str], base_model: str, seed: int = 42) -> dict:
    """LLaMA-Factory's LoRA setup on our model: the adapters listed in ``adapter_name_or_path`` are merged into the
    base, all but the one training continues (``lora.resume``; none with ``create_new_adapter``: a new one starts)
    as ``lora`` planned it. Returns the trained adapter's adapter_config.json."""
    for path in adapters[:-1] if lora.resume else adapters:
        apply_lora(model, LoraSettings.from_peft(read_adapter_config(path), seed))
        load_adapter(model, path)
        merge_lora(model)
    run = apply_lora(model, lora.settings, planned=list(lora.targets))
    if lora.resume:
        load_adapter(model, lora.resume)
    return peft_config(lora.settings, run.targets, base_model)


def merge_adapter(adapter: str, base_model: str, output: str, dtype: torch.dtype | None = None) -> list[str]:
    """Base model + peft adapter → full HF weights (peft's own merge, in fp32), written into ``output``; returns
    the tokenizer and other side files copied from the adapter's folder."""
    config = transformers.AutoConfig.from_pretrained(base_model)
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") else \
        transformers.AutoModelForCausalLM
    model = auto.from_pretrained(base_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    staging = f"{os.path.abspath(output)}.tmp-{os.getpid()}"
    try:
        merged.to(dtype or getattr(config, "dtype", None) or torch.float32).save_pretrained(staging)
        copied = copy_side_files(adapter, staging)
        if os.path.isfile(os.path.join(adapter, V_HEAD_SAFE_WEIGHTS_NAME)):  # a reward model's head, kept beside it
            shutil.copy(os.path.join(adapter, V_HEAD_SAFE_WEIGHTS_NAME), staging)
            copied.append(V_HEAD_SAFE_WEIGHTS_NAME)
        move_into(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return copied
