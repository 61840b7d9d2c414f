"""run_pt / run_sft / run_dpo, reached through LLaMA-Factory's own dispatch under USE_MCA=1."""


def _missing(stage: str):
    raise NotImplementedError(f"llamafactory_mca: the {stage} workflow is not built yet (training issue).")


def run_pt(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _missing("pt")


def run_sft(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _missing("sft")


def run_dpo(model_args, data_args, training_args, finetuning_args, callbacks=None):
    _missing("dpo")
