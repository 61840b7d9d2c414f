"""How LLaMA-Factory finds us under ``USE_MCA=1`` without a line of it being edited.

LLaMA-Factory 0.9.x, when ``USE_MCA=1``, imports its argument classes from a module named
``mcore_adapter`` and its pt/sft/dpo workflows from ``llamafactory.train.mca``. The installed startup
hook (``llamafactory_mca.pth``, one line) calls :func:`install` only when ``USE_MCA`` is on; install
puts an import finder first on ``sys.meta_path`` that answers those two names with our modules.
``LLAMAFACTORY_MCA_DISABLE=1`` turns the backend off: LLaMA-Factory reads ``USE_MCA`` itself (its parser then needs
``mcore_adapter``, its launcher forces torchrun), so the hook takes ``USE_MCA`` out of the environment and the run
is LLaMA-Factory's default path (:func:`turn_off`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import signal
import sys
import types

from .. import __version__
from ..compat import JIT_MODULE, compile_on_first_call, version_note
from ..errors import UserError
from ..quiet import quiet_third_party
from . import torchrun


ADAPTER_NAME = "mcore_adapter"
WORKFLOW_NAME = "llamafactory.train.mca"
_TRUE = ("1", "true", "y", "yes", "on")

# What each aliased name exposes, and where it comes from.
_EXPORTS = {
    ADAPTER_NAME: ("llamafactory_mca.training_args", ("TrainingArguments", "Seq2SeqTrainingArguments")),
    WORKFLOW_NAME: ("llamafactory_mca.workflow", ("run_pt", "run_sft", "run_dpo", "run_kto", "run_rm")),
}


DISABLE_ENV = "LLAMAFACTORY_MCA_DISABLE"


def env_enabled(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in _TRUE


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None  # default module creation

    def exec_module(self, module: types.ModuleType) -> None:
        source, names = _EXPORTS[module.__name__]
        target = importlib.import_module(source)
        for name in names:
            setattr(module, name, getattr(target, name))
        module.__path__ = []  # a package, so `mcore_adapter.x` fails with a clear ModuleNotFoundError
        module.__llamafactory_mca__ = source


MISC_NAME = "llamafactory.extras.misc"
PARSER_NAME = "llamafactory.hparams.parser"
LAUNCHER_NAME = "llamafactory.launcher"
TUNER_NAME = "llamafactory.train.tuner"


def _guard_train_args(module: types.ModuleType) -> None:
    """LLaMA-Factory sends stages other than pt/sft/dpo to its own trainers even under USE_MCA=1, where they
    would fail obscurely; check the parsed request (stage, finetuning type, ...) right after parsing. This is the
    request's one check in each process (the launcher's and each worker's): ``plan.plan_run`` does not repeat it."""
    parse = module.get_train_args

    def get_train_args(args=None):
        # here, not at the top: the startup hook of every Python process must not import Megatron (plan does)
        from ..plan import check_request
        from ..stages import check_recipe

        recipe = module.read_args(args)
        if os.environ.get("LOCAL_RANK") is not None:  # a worker: our process group first, see _join_process_group
            _join_process_group(recipe)
        if isinstance(recipe, dict):
            check_recipe(recipe)
        parsed = parse(args)

        model_args, data_args, training_args, finetuning_args = parsed[:4]
        check_request(finetuning_args.stage, model_args, data_args, training_args, finetuning_args)
        return parsed

    module.get_train_args = get_train_args


ROUTED = ("run_rm", "run_kto")  # the tuner's names for them, which it calls at run time


def _route_stages(module: types.ModuleType) -> None:
    """LLaMA-Factory's tuner hands only pt, sft and dpo to its Megatron workflows and sends rm and kto to its own
    trainers even under USE_MCA=1: a USE_MCA run's rm and kto go to ours."""
    for name in ROUTED:
        _route(module, name)


def _route(module: types.ModuleType, name: str) -> None:
    own = getattr(module, name)

    def run(model_args, data_args, training_args, finetuning_args, callbacks=None):
        if not getattr(finetuning_args, "use_mca", False):
            return own(model_args, data_args, training_args, finetuning_args, callbacks)
        workflow = importlib.import_module(_EXPORTS[WORKFLOW_NAME][0])
        return getattr(workflow, name)(model_args, data_args, training_args, finetuning_args, callbacks)

    setattr(module, name, run)


def _join_process_group(recipe) -> None:
    """Create the process group before Hugging Face's TrainingArguments does (it would, with ddp_timeout as the
    group's timeout): ours is a minute longer, so the watchdog's message (rank, step, operation) comes first. The
    watchdog starts first: a launcher killed now takes the rendezvous store with it, and the join would wait."""
    from .. import watchdog  # here: this module loads at every interpreter start
    from ..parallel import init_distributed  # here: imports torch, and this module loads at every start

    timeout = 1800.0
    if isinstance(recipe, dict):
        timeout = float(recipe.get("ddp_timeout") or timeout)
    else:
        for i, arg in enumerate(recipe):
            if arg.startswith("--ddp_timeout"):
                timeout = float(arg.split("=", 1)[1] if "=" in arg else recipe[i + 1])
    watchdog.start(timeout, int(os.environ.get("RANK", "0")))
    init_distributed(timeout)


class _Torchrun:
    """``subprocess`` for LLaMA-Factory's launcher: its ``torchrun ...`` command runs our torchrun (torchrun.py) in
    this process, with the same arguments as the user typed them (LLaMA-Factory joins them with spaces and splits the
    command again, which takes apart a recipe path or a ``key=value`` holding a space); everything else is the real
    module."""

    def __init__(self, real: types.ModuleType, script: str, train_args: list[str]) -> None:
        self._real, self._script, self._train_args = real, script, train_args
        self.started = False

    def run(self, command, *args, **kwargs):
        if command and command[0] == "torchrun" and self._script in command:
            options = command[1:command.index(self._script) + 1]
            os.environ.update(kwargs.get("env") or {})  # what LLaMA-Factory's launcher adds for its torchrun
            self.started = True
            return self._real.CompletedProcess(command, torchrun.main([*options, *self._train_args],
                                                                      in_launcher=True))
        return self._real.run(command, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def quiet_ctrl_c_while_importing() -> None:
    """The launcher imports LLaMA-Factory (seconds) before its launch, where Ctrl-C is handled: one line meanwhile,
    not the traceback of whichever import it interrupted."""
    def stop(signum, frame):
        print("[llamafactory_mca] interrupted before any worker started", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGINT)  # in the middle of an import: nothing of this process is worth finishing

    signal.signal(signal.SIGINT, stop)


def _take_over_launch(module: types.ModuleType) -> None:
    """``llamafactory-cli train``: our preflight (every check, in this process, before any worker), then
    LLaMA-Factory's own launch with our torchrun."""
    original = module.launch

    def launch():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the imports are done: Ctrl-C is handled here
        swapped = None
        try:
            if len(sys.argv) > 1 and sys.argv[1] == "train":
                from .preflight import run_preflight  # here: only a launcher checks a recipe

                run_preflight(sys.argv[2:])
                swapped = module.subprocess = _Torchrun(module.subprocess, module.__file__, sys.argv[2:])
            original()
        except KeyboardInterrupt:
            started = swapped is not None and swapped.started
            print(f"[llamafactory_mca] interrupted{'' if started else ' before any worker started'}",
                  file=sys.stderr, flush=True)
            raise SystemExit(130) from None

    module.launch = launch


def _board(name: str):
    """LlamaBoard's modules, adjusted by launch/board.py: imported only by the web UI (it imports gradio)."""
    def patch(module: types.ModuleType) -> None:
        importlib.import_module("llamafactory_mca.launch.board").PATCHES[name](module)

    return patch


BOARD_MODULES = ("llamafactory.webui.locales", "llamafactory.webui.components.train", "llamafactory.webui.runner",
                 "llamafactory.webui.control", "llamafactory.webui.components.export")
_PATCHES = {PARSER_NAME: _guard_train_args, LAUNCHER_NAME: _take_over_launch, TUNER_NAME: _route_stages,
            JIT_MODULE: compile_on_first_call, **{n: _board(n) for n in BOARD_MODULES}}
# what must hold while a module runs (its import-time checks)
_WHILE_IMPORTING = {MISC_NAME: torchrun.bf16_answered_by_nvml}


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real module (under what must hold while it imports), then adjusts it (LLaMA-Factory's argument parser
    and launcher, LlamaBoard's page)."""

    def __init__(self, loader: importlib.abc.Loader, patch, around=contextlib.nullcontext) -> None:
        self.loader, self.patch, self.around = loader, patch, around

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        with self.around():
            self.loader.exec_module(module)
        self.patch(module)


class McaFinder(importlib.abc.MetaPathFinder):
    """Answers ``mcore_adapter`` and ``llamafactory.train.mca`` with llamafactory_mca's modules, and adjusts
    LLaMA-Factory's argument parser and launcher (and keeps its extras from initialising CUDA on import) and
    Megatron's ``jit_fuser`` (compat.py)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname in _PATCHES or fullname in _WHILE_IMPORTING:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, _PATCHES.get(fullname, lambda module: None),
                                              _WHILE_IMPORTING.get(fullname, contextlib.nullcontext))
            return spec
        if fullname not in _EXPORTS:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=True)


def _other_mcore_adapter() -> str | None:
    """Where a separately installed (ROLL) mcore_adapter lives, if any."""
    for finder in sys.meta_path:
        if isinstance(finder, McaFinder) or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(ADAPTER_NAME, None)
        except Exception:
            continue
        if spec is not None:
            return spec.origin or str(spec.submodule_search_locations)
    return None


_ANNOUNCED = "LLAMAFACTORY_MCA_ANNOUNCED"


def _should_announce() -> bool:
    """Once per launch: the first process; its children (torchrun, ranks, checkpoint writers) inherit the mark."""
    if os.environ.get(_ANNOUNCED):
        return False
    os.environ[_ANNOUNCED] = "1"
    return True


_INSTALLED = False


def install() -> None:
    """Activate the backend in this process (idempotent)."""
    global _INSTALLED
    if _INSTALLED or env_enabled(DISABLE_ENV):
        return
    _INSTALLED = True
    skip_the_final_collection()
    other = _other_mcore_adapter()
    sys.meta_path.insert(0, McaFinder())
    quiet_worker()
    if _should_announce():
        line = f"[llamafactory_mca] USE_MCA=1: Megatron-Core backend llamafactory_mca {__version__} is active"
        if other:
            line += f" (ROLL's mcore_adapter at {other} is installed too and is not used)"
        print(line, file=sys.stderr)
        note = version_note()
        if note:
            print(note, file=sys.stderr)


def skip_the_final_collection() -> None:
    """At exit, after the atexit handlers: freeze every object, so the interpreter's last garbage collection skips
    them. A process that imported torch, transformers and LLaMA-Factory spends about 2 s of CPU in that collection
    (the launcher, torchrun and every rank, one after another), and what it would free goes back with the process;
    modules are still torn down and files still flushed and closed."""
    atexit.register(gc.freeze)


def quiet_worker() -> None:
    """In a worker (torchrun sets RANK): only rank 0 speaks through LLaMA-Factory's logger, as it does through
    ours; warnings from every rank stay. Set before LLaMA-Factory's logging reads the variable, and on its logger
    for a rank forked after LLaMA-Factory was imported (launch/torchrun.py)."""
    quiet_third_party()
    if os.environ.get("RANK", "0") != "0":
        os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
        logging.getLogger("llamafactory").setLevel(logging.WARNING)


def turn_off() -> None:
    """``USE_MCA=1`` with ``LLAMAFACTORY_MCA_DISABLE=1``: LLaMA-Factory's default path, as if USE_MCA were unset.

    Merely not installing the finder is not off: LLaMA-Factory reads USE_MCA itself, and then asks torchrun for one
    process per GPU (none on a CPU machine) and imports ``mcore_adapter``, which nothing answers. Dropping the
    variable here is safe because this runs from the startup hook, before any of LLaMA-Factory is imported, and
    clear because of the one line below. Children inherit the environment without it, so the line is said once."""
    os.environ.pop("USE_MCA", None)
    print(f"[llamafactory_mca] {DISABLE_ENV}=1: USE_MCA is removed from this process's environment, so LLaMA-Factory "
          "runs its default path (unset LLAMAFACTORY_MCA_DISABLE to train with Megatron-Core)", file=sys.stderr)


def refuse_when_disabled(command: str) -> None:
    """Our own commands (``llamafactory-mca train``, ``demo``) are the Megatron-Core backend; with the off switch set
    they would start LLaMA-Factory's default path under our name."""
    if env_enabled(DISABLE_ENV):
        raise UserError(f"{DISABLE_ENV}={os.environ[DISABLE_ENV]} turns the Megatron-Core backend off, and "
                        f"`llamafactory-mca {command}` is that backend: unset {DISABLE_ENV}, or use "
                        "`llamafactory-cli train` for LLaMA-Factory's default path.")


def startup_hook() -> None:
    """Called by the installed .pth file at interpreter start: inert unless USE_MCA is on."""
    if not env_enabled("USE_MCA"):
        return
    try:
        if env_enabled(DISABLE_ENV):
            turn_off()
        else:
            install()
            if os.path.basename(sys.argv[0]) == "llamafactory-cli" and sys.argv[1:2] == ["train"]:
                torchrun.keep_cuda_for_workers()
                quiet_ctrl_c_while_importing()
    except Exception as err:  # never break an interpreter at start-up
        print(f"[llamafactory_mca] activation failed: {err!r}", file=sys.stderr)
