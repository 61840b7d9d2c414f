"""LlamaBoard (``llamafactory-cli webui``) under USE_MCA=1: LLaMA-Factory's own page, trained on the Megatron path.

The page writes a recipe from its form and starts ``llamafactory-cli train`` on it with its own environment, so under
USE_MCA=1 our launcher already runs; its progress bar, loss plot and output box follow ``trainer_log.jsonl``, which we
write, and Abort ends the process tree (our torchrun takes its workers with it). What the page lacks is the
Megatron keys, our checks before a start, our checkpoint folders and our merge. The activation hook (plugin.py),
installed only under USE_MCA=1, adjusts these modules as they are imported; without it the page is LLaMA-Factory's:

- ``components.train``: the Megatron group at the top of the Train tab, with our recipes' defaults, and a line under
  it with the layout, the global batch and the planner's memory per GPU, redone as the form changes;
- ``runner``: the group's values become recipe keys; Preview and Start refuse a form with the launcher's own one-line
  message (``preflight.check_recipe``), and the preview names USE_MCA=1;
- ``control``: the checkpoint list also offers our ``checkpoint-N`` folders (to start a full run from, or to export);
  runs to resume are in LLaMA-Factory's output-dir list already (Start on one resumes its newest complete checkpoint);
- ``components.export``: one of our checkpoints is exported by our merge;
- ``locales``: the group's labels.

Which keys a stage or a model can use is decided by the launcher's checks; the page asks them, and hides the expert
keys for a model without experts and the virtual pipeline size without a pipeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import gradio as gr

from ..args import LAYOUT_KEY
from ..checkpoints import is_checkpoint
from ..checkpoints import list_checkpoints as our_checkpoints
from ..errors import UserError
from ..planner.check import TERMS, training_of, visible_gpu_memory_gib
from ..planner.memory import estimate
from ..tools.merge import merge
from .preflight import check_recipe


# The layout sizes the group sets: each one's element is named mca_<size>.
SIZES = ("tp", "pp", "vpp", "cp", "ep")
# Element name -> the recipe key it sets; the widgets and their defaults (our recipes') are in megatron_group.
KEYS = {
    **{f"mca_{size}": LAYOUT_KEY[size] for size in SIZES}, "mca_sp": "sequence_parallel",
    "mca_packing": "sequence_packing",
    "mca_recompute": "recompute_granularity", "mca_dist_opt": "use_distributed_optimizer",
    "mca_overlap_grad": "overlap_grad_reduce", "mca_overlap_param": "overlap_param_gather",
    "mca_dispatcher": "moe_token_dispatcher_type",
}
_LABELS = {
    "mca_tab": ("Megatron (USE_MCA=1)", None),
    "mca_tp": ("Tensor parallel", "tensor_model_parallel_size (TP)"),
    "mca_pp": ("Pipeline parallel", "pipeline_model_parallel_size (PP)"),
    "mca_vpp": ("Virtual pipeline", "virtual_pipeline_model_parallel_size: model chunks per pipeline stage"),
    "mca_cp": ("Context parallel", "context_parallel_size (CP)"),
    "mca_ep": ("Expert parallel", "expert_model_parallel_size (EP)"),
    "mca_sp": ("Sequence parallel", "sequence_parallel (needs TP > 1)"),
    "mca_packing": ("Sequence packing", "sequence_packing: rows packed without attention across them"),
    "mca_recompute": ("Recompute", "recompute_granularity: none, selective or full"),
    "mca_dist_opt": ("Distributed optimizer", "use_distributed_optimizer: optimizer states sharded over DP"),
    "mca_overlap_grad": ("Overlap grad reduce", "overlap_grad_reduce (distributed optimizer)"),
    "mca_overlap_param": ("Overlap param gather", "overlap_param_gather (distributed optimizer)"),
    "mca_dispatcher": ("MoE dispatcher", "moe_token_dispatcher_type"),
    "mca_summary": ("Plan", None),
}
USE_MCA = "USE_MCA=1"
LANGS = ("en", "ru", "zh", "ko", "ja")  # LLaMA-Factory's languages; the keys are Megatron's names in each


def patch_locales(module) -> None:
    for name, (label, info) in _LABELS.items():
        entry = {"label": label, **({"info": info} if info else {})}
        module.LOCALES[name] = {lang: entry for lang in LANGS}


def megatron_group() -> dict[str, Any]:
    """The group's widgets, each named as in ``KEYS``, at our recipes' defaults."""
    with gr.Accordion(open=True) as tab:
        with gr.Row():
            tp = gr.Slider(minimum=1, maximum=64, value=1, step=1, elem_id="mca_tp")
            pp = gr.Slider(minimum=1, maximum=64, value=1, step=1, elem_id="mca_pp")
            vpp = gr.Slider(minimum=1, maximum=16, value=1, step=1, visible=False, elem_id="mca_vpp")
            cp = gr.Slider(minimum=1, maximum=64, value=1, step=1, elem_id="mca_cp")
            ep = gr.Slider(minimum=1, maximum=256, value=1, step=1, visible=False, elem_id="mca_ep")
        with gr.Row():
            sp = gr.Checkbox(value=False, elem_id="mca_sp")
            packing = gr.Checkbox(value=True, elem_id="mca_packing")
            dist_opt = gr.Checkbox(value=True, elem_id="mca_dist_opt")
            overlap_grad = gr.Checkbox(value=True, elem_id="mca_overlap_grad")
            overlap_param = gr.Checkbox(value=True, elem_id="mca_overlap_param")
            recompute = gr.Dropdown(choices=["none", "selective", "full"], value="none", elem_id="mca_recompute")
            dispatcher = gr.Dropdown(choices=["alltoall", "allgather"], value="alltoall", visible=False,
                                     elem_id="mca_dispatcher")
        summary = gr.Markdown(elem_id="mca_summary")
    return dict(mca_tab=tab, mca_tp=tp, mca_pp=pp, mca_vpp=vpp, mca_cp=cp, mca_ep=ep, mca_sp=sp, mca_packing=packing,
                mca_dist_opt=dist_opt, mca_overlap_grad=overlap_grad, mca_overlap_param=overlap_param,
                mca_recompute=recompute, mca_dispatcher=dispatcher, mca_summary=summary)


def recipe_keys(value) -> dict[str, Any]:
    """The group's values (``value(name)``) as recipe keys; left-out keys keep the recipe defaults."""
    keys = {key: value(name) for name, key in KEYS.items()}
    for size in SIZES:
        keys[LAYOUT_KEY[size]] = int(keys[LAYOUT_KEY[size]])
    if keys[LAYOUT_KEY["pp"]] == 1 or keys[LAYOUT_KEY["vpp"]] == 1:
        keys[LAYOUT_KEY["vpp"]] = None
    if keys["recompute_granularity"] == "none":
        keys["recompute_granularity"] = None
    return keys


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    """The launcher's checks record the world they plan in NPROC_PER_NODE; this process starts many runs, each of
    which must plan its own. Only what changed is put back: the server's other threads read the environment (a
    Start copies it for its run), so it is never emptied, not even for a moment."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            os.environ.pop(key, None)
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def check(args: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The launcher's checks on the page's arguments: (plan, training_args, finetuning_args), or UserError with the
    launcher's message."""
    with _environment_kept():
        try:
            return check_recipe(dict(args), "the Train tab")
        except ValueError as err:  # LLaMA-Factory's parser refuses with ValueError; the launcher prints it as ours
            raise UserError(str(err)) from err


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def describe(args: dict[str, Any], lang: str = "en") -> tuple[str, bool | None]:
    """The summary under the group (layout, global batch, memory per GPU) and whether the model has experts (None:
    the checks refused the form, whose message the summary is)."""
    try:
        plan, training_args, finetuning_args = check(args)
    except UserError as err:
        return f"**Not ready:** {on_page(one_line(err), lang)}", None
    layout = plan.layout
    memory = estimate(plan.config, layout, training_of(plan, training_args, finetuning_args))
    budget = visible_gpu_memory_gib()
    fits = "" if budget is None else \
        f" of {budget:.0f} GiB ({'fits' if memory['needs'] <= budget else 'does not fit'})"
    terms = ", ".join(f"{k} {memory[k]:.2f}" for k in TERMS)
    text = (f"**{layout.describe()}** · global batch **{layout.global_batch_size}** = dp {layout.dp} × micro-batch "
            f"{layout.micro_batch_size} × accumulation {layout.grad_accum} · predicted memory per GPU "
            f"**{memory['needs']:.2f} GiB**{fits} (peak {memory['peak']:.2f}: {terms})")
    return text, bool(plan.config.num_experts)


# LLaMA-Factory's controls with no say on this path: its packing switches (the group's "Sequence packing" is the one;
# both on the page wrote `--packing False` beside `--sequence_packing True`) and DeepSpeed's (Megatron shards instead).
HIDDEN = ("packing", "neat_packing", "ds_stage", "ds_offload")
# Recipe keys whose element on LLaMA-Factory's page is named otherwise.
_ELEMENT_OF = {"per_device_train_batch_size": "batch_size", "model_name_or_path": "model_path",
               "stage": "training_stage"}


def on_page(message: str, lang: str) -> str:
    """A refusal as the page shows it: the launcher's line (the recipe's key names), then what each key it names is
    called on this page."""
    from llamafactory.webui.locales import LOCALES  # here: this module loads while LLaMA-Factory's web UI does

    names = {**{key: name for name, key in KEYS.items()}, **_ELEMENT_OF}
    named = []
    for key in dict.fromkeys(re.findall(r"[a-z][a-z0-9_]*[a-z0-9]", message)):
        entry = LOCALES.get(names.get(key, key), {})
        label = (entry.get(lang) or entry.get("en") or {}).get("label")
        if label and label.lower() != key.replace("_", " "):  # not "dataset" is "Dataset"
            named.append(f"{key} is \"{label}\"")
    return message + (f" (on this page: {'; '.join(named)})" if named else "")


def patch_train_tab(module) -> None:
    """The group goes first on the Train tab; its widgets join the inputs of Preview, Save and Start."""
    original = module.create_train_tab

    def create_train_tab(engine):
        group = megatron_group()
        widgets = {v for k, v in group.items() if k in KEYS}
        inputs: set = set()
        base = engine.manager.get_base_elems

        def with_group():
            inputs.update(base(), widgets)
            return inputs  # the very set the tab fills with its own inputs

        engine.manager.get_base_elems = with_group
        try:
            elems = original(engine)
        finally:
            del engine.manager.get_base_elems  # the class's method again
        for name in HIDDEN:
            elems[name].visible = False
        runner = engine.runner

        def refresh(data):
            try:
                args = runner._parse_train_args(data)
            except (ValueError, KeyError) as err:  # a number field that is not a number
                return {group["mca_summary"]: f"**Not ready:** {one_line(err)}"}
            text, experts = describe(args, data[engine.manager.get_elem_by_id("top.lang")])
            pipeline = int(data[group["mca_pp"]]) > 1
            out = {group["mca_summary"]: text, group["mca_vpp"]: gr.update(visible=pipeline)}
            if experts is not None:
                out.update({group["mca_ep"]: gr.update(visible=experts),
                            group["mca_dispatcher"]: gr.update(visible=experts)})
            return out

        manager = engine.manager
        triggers = [w.change for w in widgets] + [
            manager.get_elem_by_id(f"top.{n}").change for n in ("model_path", "finetuning_type", "template")] + [
            elems[n].change for n in ("training_stage", "batch_size", "gradient_accumulation_steps", "cutoff_len",
                                      "dataset", "extra_args")]
        gr.on(triggers, refresh, inputs, [group[n] for n in ("mca_summary", "mca_vpp", "mca_ep", "mca_dispatcher")],
              trigger_mode="always_last", show_progress="hidden")
        return {**group, **elems}

    module.create_train_tab = create_train_tab


def patch_runner(module) -> None:
    """The form's Megatron keys into the recipe; the launcher's checks before Preview and Start."""
    runner = module.Runner
    parse, initialize, gen_cmd = runner._parse_train_args, runner._initialize, module.gen_cmd

    def _parse_train_args(self, data):
        args = parse(self, data)
        get = lambda elem_id: data[self.manager.get_elem_by_id(elem_id)]  # noqa: E731 (as LLaMA-Factory's)
        for key in ("packing", "neat_packing", "deepspeed"):  # the hidden controls' keys (see HIDDEN)
            args.pop(key, None)
        args.update(recipe_keys(lambda name: get(f"train.{name}")))
        args.update(json.loads(get("train.extra_args")))  # the form's extra arguments still have the last word
        return args

    def _initialize(self, data, do_train, from_preview):
        error = initialize(self, data, do_train, from_preview)
        if error or not do_train:
            return error
        try:
            check(self._parse_train_args(data))
        except UserError as err:
            return on_page(one_line(err), data[self.manager.get_elem_by_id("top.lang")])
        return ""

    runner._parse_train_args, runner._initialize = _parse_train_args, _initialize
    module.gen_cmd = lambda args: gen_cmd(args).replace("llamafactory-cli", f"{USE_MCA} llamafactory-cli", 1)


def patch_control(module) -> None:
    """Our checkpoint-N folders in the checkpoint list, as what a full run starts from or Export merges. (Runs to
    resume are offered already: the output-dir list finds their checkpoint-N folders, and a run restarted on one
    resumes from the newest complete checkpoint.)"""
    list_checkpoints = module.list_checkpoints

    def list_checkpoints_ours(model_name, finetuning_type):
        dropdown = list_checkpoints(model_name, finetuning_type)
        save_dir = module.get_save_dir(model_name, finetuning_type) if model_name else None
        if not save_dir or not os.path.isdir(save_dir):
            return dropdown
        found = [choice[0] if isinstance(choice, tuple) else choice for choice in dropdown.choices]
        found += [path for run in sorted(os.listdir(save_dir))
                  for _, path in our_checkpoints(os.path.join(save_dir, run))]
        multiselect = finetuning_type in module.PEFT_METHODS  # LoRA: a list of adapters, as LLaMA-Factory's
        return gr.Dropdown(value=[] if multiselect else None, choices=found, multiselect=multiselect)

    module.list_checkpoints = list_checkpoints_ours


def patch_export(module) -> None:
    """Export of one of our checkpoints: our merge (Hugging Face weights; a LoRA checkpoint merged into its base)."""
    save_model = module.save_model

    def save_model_ours(lang, model_name, model_path, finetuning_type, checkpoint_path, template, export_size,
                        export_quantization_bit, *rest):
        export_dir, hub_model_id = rest[3], rest[4]
        chosen = checkpoint_path if isinstance(checkpoint_path, list) else [checkpoint_path] if checkpoint_path else []
        paths = [module.get_save_dir(model_name, finetuning_type, c) for c in chosen]
        if len(paths) != 1 or not is_checkpoint(paths[0]) or not export_dir:
            yield from save_model(lang, model_name, model_path, finetuning_type, checkpoint_path, template,
                                  export_size, export_quantization_bit, *rest)
            return
        asked = {"export_quantization_bit": export_quantization_bit, "export_hub_model_id": hub_model_id}
        for key, value in asked.items():
            if value not in (None, "", "none"):
                yield (f"{key}={value!r} with {paths[0]}, a llamafactory_mca checkpoint: Export merges it into "
                       f"Hugging Face weights only. Clear {key} and export; then set Model path to the exported "
                       "folder and export that with it.")
                return
        yield module.ALERTS["info_exporting"][lang]
        try:
            merge(paths[0], export_dir, max_shard_bytes=int(export_size) * 1024**3,
                  merge_lora=finetuning_type in module.PEFT_METHODS)
        except UserError as err:
            yield one_line(err)
            return
        yield module.ALERTS["info_exported"][lang]

    module.save_model = save_model_ours


PATCHES = {
    "llamafactory.webui.locales": patch_locales,
    "llamafactory.webui.components.train": patch_train_tab,
    "llamafactory.webui.runner": patch_runner,
    "llamafactory.webui.control": patch_control,
    "llamafactory.webui.components.export": patch_export,
}
