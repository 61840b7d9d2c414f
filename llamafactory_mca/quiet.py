"""Third-party noise, folded: a successful run prints the startup summary, a progress bar and one line per
logging step, not the model config five times and two dozen warnings from every rank.

What is hidden only ever says something the startup summary already says in one line (Transformer Engine
and apex are absent, so the native kernels run), is a deprecation inside a library we pin (Megatron's
own calls into torch.distributed), or is advice that is wrong where it is given (LLaMA-Factory's "enable mixed
precision" on a machine without GPUs, where the run is fp32 on purpose and the summary says so). Our own warnings
are fixed at their source, not filtered here.
``LLAMAFACTORY_MCA_DEBUG=1`` keeps everything.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from .errors import debug_enabled


# (category, message regex) of warnings that only restate "no TE / no apex" or are library-internal deprecations.
_WARNINGS = (
    (UserWarning, r".*(Transformer Engine|Apex|apex) (and Apex )?(is|are) not installed"),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor|_all_gather_base|"
                    r"_reduce_scatter_base)` is deprecated"),
    (UserWarning, r"torch\.distributed is disabled"),  # a plain merge process reading a dist checkpoint on purpose
    # megatron-core 0.16's torch_dist checkpoint strategy: torch's old DCP entry point and its ShardedTensor
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load`"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
# Loggers whose messages below ERROR say nothing a user can act on here.
_LOGGERS = (
    "torch.utils.cpp_extension",  # "No CUDA runtime is found" on CPU machines
    "megatron.core.rerun_state_machine",  # "RerunStateMachine initialized in mode DISABLED"
    "torch.distributed.elastic.multiprocessing.redirects",  # "NOTE: Redirects are currently not supported ..."
)


MIXED_PRECISION_ADVICE = "We recommend enable mixed precision training."


class CpuPrecisionAdvice(logging.Filter):
    """LLaMA-Factory's parser recommends bf16/fp16 whenever neither is set. Without a GPU that is noise on every
    run: a CPU run (tests, the demo, a laptop) trains in fp32 on purpose, and the startup summary says fp32. On GPUs
    the advice stands and is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != MIXED_PRECISION_ADVICE:
            return True
        import torch

        return torch.cuda.is_available()


def quiet_third_party() -> None:
    """Install the filters in this process (idempotent; workers inherit nothing, each calls it at start)."""
    if debug_enabled():
        return
    for category, message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    parser_logger = logging.getLogger("llamafactory.hparams.parser")  # what LLaMA-Factory's get_logger returns
    if not any(isinstance(f, CpuPrecisionAdvice) for f in parser_logger.filters):
        parser_logger.addFilter(CpuPrecisionAdvice())


def quiet_transformers() -> None:
    """LLaMA-Factory sets transformers' logging to INFO on the main process, which prints every config it loads
    (five times per run) and every tokenizer file saved; warnings stay. The datasets library's progress bars stay
    where a terminal shows them; in a log file each of their updates would be a line."""
    if debug_enabled():
        return
    import transformers

    transformers.utils.logging.set_verbosity_warning()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning")
    if not sys.stderr.isatty():
        import datasets

        datasets.disable_progress_bars()
