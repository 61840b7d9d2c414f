"""The experiment trackers ``report_to`` names (TensorBoard, W&B, MLflow, SwanLab, ...): Hugging Face's own callbacks.

Hugging Face's Trainer adds them itself (``get_reporting_integration_callbacks``); McaTrainer builds its
``CallbackHandler`` without the Trainer, so :func:`reporting_callbacks` adds the same classes there. They get the same
``on_log`` calls that LLaMA-Factory's ``trainer_log.jsonl`` is written from, on every rank, and each writes only where
``state.is_world_process_zero``, as under the Trainer: one run per training run, the same scalars as the jsonl.

At setup they log the run's arguments and read the model: ``model.config`` (``to_dict``/``to_json_string``, or a dict)
and ``model.num_parameters()``. McaModel's config is Megatron's, so they are handed :class:`ReportedModel` instead:
the checkpoint's config.json and the whole model's parameter count (every rank holds only a part).

:func:`missing_package` says, before any worker starts, what a named tracker lacks; without it each rank would die in
its callback's constructor, or in LLaMA-Factory's ``use_swanlab`` import.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from transformers.integrations import TensorBoardCallback, get_reporting_integration_callbacks

from ..models.cost import model_parameter_count


# integration -> (modules it imports, what to pip install); any one module of a tuple of alternatives will do
PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
    "swanlab": (("swanlab",), "swanlab"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "neptune": (("neptune",), "neptune"),
    "clearml": (("clearml",), "clearml"),
    "dvclive": (("dvclive",), "dvclive"),
    "codecarbon": (("codecarbon",), "codecarbon"),
    "trackio": (("trackio",), "trackio"),
    "azure_ml": (("azureml",), "azureml-core"),
    "dagshub": (("dagshub",), "dagshub mlflow"),
    "flyte": (("flytekit",), "flytekit flytekitplugins-deck-standard"),
    "kubeflow": ((), ""),  # a server named by the environment, no package
}
ALL_OF = {"dagshub": ("mlflow",), "flyte": ("flytekitplugins.deck",)}


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module left half-uninstalled
        return False


def missing_package(integration: str) -> str | None:
    """What to ``pip install`` for ``integration`` when a module it needs is not importable, else None. Unknown names
    are :func:`reporting_callbacks`' (Hugging Face's) to refuse."""
    if integration not in PACKAGES:
        return None
    any_of, pip_name = PACKAGES[integration]
    if any_of and not any(_found(m) for m in any_of) or not all(_found(m) for m in ALL_OF.get(integration, ())):
        return pip_name
    return None


def reporting_callbacks(args: Any) -> list:
    """An instance of Hugging Face's callback for each integration in ``args.report_to`` (none for ``none`` or
    ``[]``). TensorBoard writes to ``logging_dir`` when the recipe sets it (transformers 5 reads only the
    ``TENSORBOARD_LOGGING_DIR`` variable, then ``output_dir/runs/<date>_<host>``, as its Trainer does)."""
    callbacks = [cls() for cls in get_reporting_integration_callbacks(args.report_to)]
    logging_dir = getattr(args, "logging_dir", None)
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback) and logging_dir:
            callback.logging_dir = os.path.expanduser(logging_dir)
    return callbacks


class ConfigDict(dict):
    """config.json as the integrations read ``model.config``: a dict (W&B, SwanLab), or with ``to_dict`` (MLflow)
    and ``to_json_string`` (TensorBoard), as a ``PretrainedConfig`` has them."""

    def to_dict(self) -> dict:
        return dict(self)

    def to_json_string(self, use_diff: bool = True) -> str:
        return json.dumps(self, indent=2, sort_keys=True, default=str) + "\n"


class ReportedModel:
    """The model the callbacks are handed: the Hugging Face config and parameter count the integrations log; every
    other attribute is McaModel's."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.config = ConfigDict(model.config.hf_config)
        self._count = model_parameter_count(model.config)

    def num_parameters(self) -> int:
        return self._count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
