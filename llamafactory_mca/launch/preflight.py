"""Every check that needs no process group, in the launching process, before torchrun starts a worker.

``llamafactory-cli train x.yaml`` under USE_MCA=1 (and ``llamafactory-mca train``) runs :func:`preflight`
first: a mistake costs seconds and prints one message, not a minute and a traceback per rank. It parses the
recipe as the workers will (LLaMA-Factory's parser with our argument classes) and makes the run's plan as the workers
will (``plan.plan_run``: the model, a hub id downloaded here once per node, the layout against the model and the world
size), then checks what only it checks: the recipe's keys, the files, the datasets, the resume point. It also takes
the output_dir lock and hands the workers what it resolved through the environment.

Files are checked as far as that is cheap: each safetensors file's header against its length, a checkpoint of ours
(to resume, or as model_name_or_path) by its metadata against its data files. Tensors are read by the workers, which
name a corrupt file or NaN weights themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from .. import start_clock
from ..args import LAYOUT_KEYS, DistributingParallelArguments, MegatronArguments
from ..errors import UserError, user_errors
from ..quiet import quiet_third_party
from ..run_lock import HELD_ENV, acquire
from ..stages import INSTEAD


# LLaMA-Factory's demo sets: in its repository's data/ folder, not in the pip package.
LLAMAFACTORY_DATA = ("identity", "alpaca_en_demo", "alpaca_zh_demo", "dpo_en_demo", "dpo_zh_demo", "kto_en_demo",
                     "glaive_toolcall_en_demo", "glaive_toolcall_zh_demo", "mllm_demo", "c4_demo", "wiki_demo")


def _recipe_name(argv: list[str]) -> str:
    if argv and argv[0].endswith((".yaml", ".yml", ".json")):
        return argv[0] + (" or its overrides" if len(argv) > 1 else "")
    return "the command line"


def read_recipe(argv: list[str]) -> dict[str, Any] | list[str]:
    """The recipe as LLaMA-Factory reads it (YAML/JSON file plus ``key=value`` overrides, or ``--key value``)."""
    # here: LLaMA-Factory takes seconds to import, and only after our hook
    from llamafactory.hparams.parser import read_args

    if argv and argv[0].endswith((".yaml", ".yml", ".json")) and not os.path.isfile(argv[0]):
        raise UserError(f"recipe {argv[0]!r} does not exist.")
    saved = sys.argv
    sys.argv = ["llamafactory-cli", *argv]
    try:
        return read_args()
    except Exception as err:  # YAML syntax and the like
        mark = getattr(err, "problem_mark", None)  # YAML's own errors span lines: where, then what
        what = (f"line {mark.line + 1}, column {mark.column + 1}: {err.problem}" if mark is not None
                and getattr(err, "problem", None) else " ".join(str(err).split()))
        raise UserError(f"cannot read {_recipe_name(argv)}: {what}") from err
    finally:
        sys.argv = saved


def _given_keys(recipe: dict[str, Any] | list[str]) -> list[str]:
    if isinstance(recipe, dict):
        return list(recipe)
    return [a[2:].split("=", 1)[0] for a in recipe if a.startswith("--")]


def check_output_dir_given(recipe: dict[str, Any] | list[str], where: str) -> None:
    """A recipe without output_dir would train into transformers' default, ./trainer_output, without a word (as
    LLaMA-Factory's default path does); a run's checkpoints and weights belong where the user says."""
    given = recipe.get("output_dir") not in (None, "") if isinstance(recipe, dict) else \
        "output_dir" in _given_keys(recipe)
    if not given:
        raise UserError(f"output_dir is not set in {where}: the run would write its checkpoints and weights into "
                        f"transformers' default, {os.path.abspath('trainer_output')}. Set output_dir (e.g. "
                        "output_dir: saves/qwen3/full/sft), or output_dir: trainer_output to keep that folder.")


def _valid_keys() -> set[str]:
    from llamafactory.hparams import parser  # here: LLaMA-Factory takes seconds to import, and only after our hook

    return {f.name for cls in parser._TRAIN_MCA_ARGS for f in fields(cls) if f.init}


def check_keys(recipe: dict[str, Any] | list[str], where: str) -> None:
    """Unknown keys, each with the nearest valid key: LLaMA-Factory's parser would list them without a hint."""
    # here: LLaMA-Factory takes seconds to import, and only after our hook
    from llamafactory.extras.misc import is_env_enabled

    if is_env_enabled("ALLOW_EXTRA_ARGS"):
        return
    valid = _valid_keys()
    unknown = [k for k in _given_keys(recipe) if k not in valid]
    if not unknown:
        return
    for key in unknown:
        if key in INSTEAD:  # LLaMA-Factory's keys the Megatron path's arguments leave out on purpose
            raise UserError(f"{key} is not supported with USE_MCA=1: {INSTEAD[key]}. Remove {key} from {where}.")
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise UserError(f"unknown key{'s' if len(unknown) > 1 else ''} in {where}: {', '.join(parts)}. Keys of "
                    "LLaMA-Factory, Hugging Face's TrainingArguments and `llamafactory-mca train --help` are "
                    "accepted.")


@contextlib.contextmanager
def _quiet_parse() -> Iterator[None]:
    """LLaMA-Factory's parser logs its conclusions; the workers log them again, so here they stay silent."""
    import transformers  # here: seconds to import; only a parse needs it

    lf_logger = logging.getLogger("llamafactory")
    level, tf_level = lf_logger.level, transformers.utils.logging.get_verbosity()
    lf_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lf_logger.setLevel(level)
        transformers.utils.logging.set_verbosity(tf_level)


def parse(recipe: dict[str, Any] | list[str]) -> tuple:
    """LLaMA-Factory's ``get_train_args`` with our classes (and our stage checks, see plugin.py), on the CPU:
    Hugging Face's argument classes pick a device while parsing, and the launcher must not hold a GPU."""
    # here: LLaMA-Factory takes seconds to import, and only after our hook
    from llamafactory.hparams.parser import get_train_args

    if isinstance(recipe, dict):
        recipe = {**recipe, "use_cpu": True}
    else:
        recipe = [*recipe, "--use_cpu", "true"]
    with _quiet_parse():
        return get_train_args(recipe)


def planned_world_size(min_world: int) -> int:
    """The world torchrun will start: NPROC_PER_NODE x NNODES as LLaMA-Factory's launcher reads them. Without
    GPUs and without NPROC_PER_NODE (LLaMA-Factory would ask for 0 processes), as many CPU processes as the
    layout needs."""
    # here: LLaMA-Factory takes seconds to import, and only after our hook
    from llamafactory.extras.misc import get_device_count

    count = get_device_count()
    if "NPROC_PER_NODE" not in os.environ:
        os.environ["NPROC_PER_NODE"] = str(count if count > 0 else min_world)
    nproc = os.environ["NPROC_PER_NODE"]
    nnodes = os.environ.get("NNODES", "1")
    if not nproc.isdigit() or int(nproc) < 1:
        raise UserError(f"NPROC_PER_NODE={nproc!r} must be a positive number of processes per node.")
    check_gpus_for(int(nproc), count)
    return int(nproc) * (int(nnodes) if nnodes.isdigit() else 1)


def check_gpus_for(nproc: int, gpus: int) -> None:
    """One process per GPU: more processes than visible GPUs would each die with CUDA's "invalid device ordinal"
    at their first allocation. Without GPUs the processes are CPU processes, as many as asked."""
    if gpus <= 0 or nproc <= gpus:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise UserError(f"NPROC_PER_NODE={nproc} asks for {nproc} processes on this node, and it has {gpus} GPU"
                    f"{'s' if gpus > 1 else ''} visible{seen}: one process per GPU. Set NPROC_PER_NODE={gpus} or "
                    "fewer (a layout that needs more GPUs: lower its parallel sizes; `llamafactory-mca plan "
                    f"RECIPE --gpus {gpus}` lists the layouts that fit), or make more GPUs visible.")


def check_reporting(training_args: Any, finetuning_args: Any) -> None:
    """Each tracker ``report_to`` names (and LLaMA-Factory's ``use_swanlab``) installed: otherwise every rank would
    fail in its callback's constructor after loading the data. ``report_to: all`` takes only what is installed."""
    from ..trainer.reporting import PACKAGES, missing_package  # here: imports transformers and torch

    for name in training_args.report_to or []:
        if name not in PACKAGES:
            raise UserError(f"report_to={name} is not a tracker transformers knows: use {', '.join(PACKAGES)} "
                            "or none.")
        package = missing_package(name)
        if package:
            raise UserError(f"report_to={name} needs {package}, which is not installed: pip install {package}, or "
                            f"drop {name} from report_to.")
    if getattr(finetuning_args, "use_swanlab", False) and missing_package("swanlab"):
        raise UserError("use_swanlab=true needs swanlab, which is not installed: pip install swanlab, or set "
                        "use_swanlab: false.")
    if "wandb" in (training_args.report_to or []):
        watch, log_model = os.environ.get("WANDB_WATCH", "false"), os.environ.get("WANDB_LOG_MODEL", "false")
        if watch in ("all", "parameters", "gradients") or log_model == "end":
            what = f"WANDB_WATCH={watch}" if watch in ("all", "parameters", "gradients") else "WANDB_LOG_MODEL=end"
            raise UserError(f"{what} is not supported with USE_MCA=1: W&B would watch or save a transformers model, "
                            "and each rank holds a Megatron part of one. Unset it (WANDB_LOG_MODEL=checkpoint "
                            "uploads the checkpoint folders).")


def check_datasets(data_args: Any, stage: str) -> None:
    """Every named dataset is in dataset_info.json (else the names it has), of the stage's kind (pairs for dpo) and,
    when it is a local file, exists and is not empty."""
    # here: LLaMA-Factory takes seconds to import, and only after our hook
    from llamafactory.data.parser import get_dataset_list

    directory = data_args.dataset_dir
    for key in ("dataset", "eval_dataset"):
        names = getattr(data_args, key) or []
        if not names:
            continue
        try:
            attrs = get_dataset_list(names, directory)
        except ValueError as err:
            raise UserError(f"{key}={','.join(names)}: {err}{_known_names(names, directory)}"
                            f"{_data_hint(names, directory)}") from err
        for name, attr in zip(names, attrs):
            if stage in ("dpo", "rm") and not attr.ranking:
                raise UserError(f"dataset {name!r} is not a preference dataset: stage {stage} trains on "
                                f"chosen/rejected pairs, and dataset_info.json in {directory} does not mark it "
                                "`\"ranking\": true` (with chosen and rejected columns; see LLaMA-Factory's "
                                "data/README.md), or use stage: sft for its rows.")
            if stage == "kto" and not attr.kto_tag:
                raise UserError(f"dataset {name!r} has no kto_tag column: stage kto trains on rows tagged desirable "
                                f"or not, and dataset_info.json in {directory} maps no `\"kto_tag\"` column. Map "
                                "one (a true/false column; see LLaMA-Factory's data/README.md), or use stage: sft "
                                "for its rows.")
            if attr.load_from != "file" or isinstance(directory, dict) or directory.startswith("REMOTE:"):
                continue
            path = os.path.join(directory, attr.dataset_name)
            if not os.path.exists(path):
                raise UserError(f"dataset {name!r}: {path} does not exist (dataset_info.json in {directory} names "
                                f"the file {attr.dataset_name!r}).{_data_hint([name], directory)}")
            if os.path.isfile(path) and _empty(path):
                raise UserError(f"dataset {name!r}: {path} holds no rows; fill it (LLaMA-Factory's data/README.md "
                                "shows each format) or take it out of the recipe's dataset list.")


def _empty(path: str) -> bool:
    if os.path.getsize(path) > 64:
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().strip() in ("", "[]", "{}")


def _known_names(names: list[str], directory: Any) -> str:
    """The dataset names dataset_info.json has, nearest to the unknown ones first."""
    path = os.path.join(directory, "dataset_info.json") if isinstance(directory, str) else None
    try:
        with open(path, encoding="utf-8") as f:
            known = list(json.load(f))
    except (OSError, TypeError, ValueError):
        return ""
    close = [c for n in names for c in difflib.get_close_matches(n, known, n=2)]
    listed = list(dict.fromkeys(close + known))
    more = f" and {len(listed) - 12} more" if len(listed) > 12 else ""
    return f" It has: {', '.join(listed[:12])}{more}."


def _data_hint(names: list[str], directory: Any) -> str:
    demo = [n for n in names if n in LLAMAFACTORY_DATA]
    if not demo:
        return ""
    where = os.path.abspath(directory) if isinstance(directory, str) else directory
    return (f" {', '.join(demo)} {'is' if len(demo) == 1 else 'are'} LLaMA-Factory's demo data, shipped in its "
            "repository's data/ folder, not in its pip package: git clone https://github.com/hiyouga/LLaMA-Factory "
            f"and set dataset_dir to LLaMA-Factory/data (dataset_dir is now {where}).")


def preflight(argv: list[str]) -> tuple[Any, str]:
    """The run's plan (``plan.plan_run``: every check that needs no process group) and what only the launcher checks:
    the recipe's keys, the model's files, the datasets, the resume point. Returns the plan and the output_dir.
    Raises UserError."""
    plan, training_args, _ = check_recipe(read_recipe(argv), _recipe_name(argv))
    check_contents(plan, training_args)
    return plan, training_args.output_dir


def check_contents(plan: Any, training_args: Any) -> None:
    """Every file the workers will read against the checksums written with it (``checkpoints/manifest.py``): the
    model, adapters, the reference model and the checkpoint to resume. Reads them all (at disk speed, in parallel), so
    it runs once at launch rather than in ``check_recipe``, which LlamaBoard calls on every Preview."""
    # here: imports torch, which `train --help` and a recipe's reading do without
    from ..checkpoints import newest_intact, resolve_resume, verify_contents

    for path in dict.fromkeys((plan.model_path, *plan.adapters, *([plan.reference[0]] if plan.reference else []))):
        if os.path.isdir(path):
            verify_contents(path)
    resume = resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir, plan.record)
    if resume is None:
        return
    try:
        verify_contents(resume)
    except UserError as err:
        other = newest_intact(os.path.dirname(os.path.abspath(resume)), besides=resume)
        fix = (f"Resume from another checkpoint instead (resume_from_checkpoint: {other})" if other else
               "No other checkpoint is there: set overwrite_output_dir: true to start over")
        raise UserError(f"cannot resume from {resume}: {err} {fix}.") from err


def check_recipe(recipe: dict[str, Any] | list[str], where: str) -> tuple[Any, Any, Any]:
    """:func:`preflight` on a recipe already read (LlamaBoard's form checks its arguments here, as the launcher it
    starts will). Returns the plan and the parsed training and finetuning arguments. Raises UserError."""
    # here: torch, Megatron and LLaMA-Factory (seconds), which `train --help` does without
    from ..checkpoints import resolve_resume
    from ..parallel import min_world_size
    from ..plan import check_finetuning_type, check_model_files, plan_run
    from ..planner.check import check_fits

    check_keys(recipe, where)
    check_output_dir_given(recipe, where)
    if isinstance(recipe, dict) and "finetuning_type" in recipe:
        check_finetuning_type(recipe["finetuning_type"])
    model_args, data_args, training_args, finetuning_args, _ = parse(recipe)
    check_reporting(training_args, finetuning_args)
    world = planned_world_size(min_world_size(training_args))
    plan = plan_run(finetuning_args.stage, model_args, data_args, training_args, finetuning_args, world, recipe)
    for path in (plan.model_path, *plan.adapters, *([plan.reference[0]] if plan.reference else [])):
        check_model_files(path)
    check_datasets(data_args, finetuning_args.stage)
    resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir, plan.record)
    check_fits(plan, training_args, finetuning_args)
    return plan, training_args, finetuning_args


def run_preflight(argv: list[str]) -> Any:
    """The launcher's entry: help, checks (one message and exit 1 on a user error), the output_dir lock; the start
    clock's first two marks (the startup line's launcher phases)."""
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(train_help())
        raise SystemExit(0)
    start_clock.start()
    quiet_third_party()
    with user_errors(also=(ValueError,)):
        plan, output_dir = preflight(argv)
        if os.environ.get("NODE_RANK", "0") == "0":
            lock = acquire(output_dir)
            atexit.register(lock.release)
            os.environ[HELD_ENV] = lock.path
    start_clock.mark(start_clock.CHECKED)
    return plan


USAGE = """usage: llamafactory-mca train RECIPE.yaml [key=value ...]
       USE_MCA=1 llamafactory-cli train RECIPE.yaml [key=value ...]

Trains with Megatron-Core. A recipe is a LLaMA-Factory YAML (model_name_or_path, stage, dataset, template,
cutoff_len, output_dir, per_device_train_batch_size, gradient_accumulation_steps, learning_rate, ...; see
LLaMA-Factory's documentation) plus the Megatron keys below. key=value after the recipe overrides it.
Experiment trackers: report_to (tensorboard, wandb, mlflow, swanlab, ... or all; rank 0 writes), logging_dir for
TensorBoard, LLaMA-Factory's use_swanlab.
Processes: NPROC_PER_NODE x NNODES (GPUs by default; without GPUs, as many CPU processes as the layout needs).
"""


def train_help() -> str:
    """The Megatron keys with their help, grouped; imports nothing heavy (answers in well under a second)."""
    groups = {
        "layout": (*LAYOUT_KEYS, "pipeline_model_parallel_layout", "sequence_parallel"),
        "engine": tuple(f.name for f in fields(MegatronArguments)
                        if f.name not in {g.name for g in fields(DistributingParallelArguments)}),
    }
    grouped = set(groups["layout"]) | set(groups["engine"])
    groups["model and kernels"] = tuple(f.name for f in fields(DistributingParallelArguments) if f.name not in grouped)
    by_name = {f.name: f for f in fields(MegatronArguments)}
    lines = [USAGE]
    for title, names in groups.items():
        lines.append(f"{title}:")
        for name in names:
            f = by_name[name]
            default = "" if f.default is None or f.default is False else f" (default {f.default})"
            lines.append(f"  {name:40s} {f.metadata.get('help', '')}{default}")
        lines.append("")
    lines.append("Environment: LLAMAFACTORY_MCA_DEBUG=1 shows tracebacks for recipe errors; "
                 "LLAMAFACTORY_MCA_DISABLE=1 turns the USE_MCA=1 hook off.")
    return "\n".join(lines)
