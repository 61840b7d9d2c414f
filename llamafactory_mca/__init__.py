"""llamafactory_mca: the Megatron-Core training backend for LLaMA-Factory (``USE_MCA=1``).

Importing the package is cheap: argument classes and workflows load on first use.
"""

__version__ = "0.1.0"

__all__ = ["Seq2SeqTrainingArguments", "TrainingArguments", "__version__"]


def __getattr__(name: str):
    if name in ("TrainingArguments", "Seq2SeqTrainingArguments"):
        from . import training_args

        return getattr(training_args, name)
    raise AttributeError(name)
