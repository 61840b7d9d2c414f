"""Which of LLaMA-Factory's stages and requests the Megatron path trains, and what works instead for the others.

Light on purpose: the launcher's key check reads it before anything heavy is imported."""

from __future__ import annotations

from .errors import UserError


SUPPORTED_STAGES = ("pt", "sft", "dpo", "kto", "rm")
PREFERENCE_STAGES = ("dpo", "kto", "rm")  # trained on a preference (pairs, tagged rows), not next-token prediction
# what works instead, for what LLaMA-Factory runs and the Megatron path does not
INSTEAD = {
    "ppo": "PPO generates rollouts every step, which Megatron's training engine does not: for preference tuning "
           "without rollouts use stage: dpo (pref_loss sigmoid, orpo or simpo) on chosen/rejected pairs",
    "do_predict": "generation over a test set is not a training step: merge the checkpoint (llamafactory-mca merge) "
                  "and run do_predict on the merged model without USE_MCA, or LLaMA-Factory's scripts/vllm_infer.py",
}
INSTEAD["predict_with_generate"] = INSTEAD["do_predict"]
GENERATION_KEYS = ("do_predict", "predict_with_generate")


def check_stage(stage: str) -> None:
    """Refuse a stage the Megatron path does not train, naming what works instead (before LLaMA-Factory's own checks
    of that stage's keys, which would ask for things the run could not use: PPO's reward_model)."""
    if stage not in SUPPORTED_STAGES:
        instead = f" {INSTEAD[stage][0].upper()}{INSTEAD[stage][1:]}." if stage in INSTEAD else ""
        raise UserError(f"stage={stage!r} is not supported with USE_MCA=1; supported: {', '.join(SUPPORTED_STAGES)}."
                        f"{instead} Unset USE_MCA to run it with LLaMA-Factory's default trainer.")


def check_no_generation(training_args) -> None:
    """Generation is no training step: refuse the keys that ask for it rather than train and skip them."""
    for key in GENERATION_KEYS:
        if getattr(training_args, key, False):
            _refuse_generation(key)


def check_recipe(recipe: dict) -> None:
    """The same checks on the recipe as written, before LLaMA-Factory's parser checks the keys these stages and
    requests bring (PPO's reward_model, do_predict's predict_with_generate) and asks for what the run cannot use."""
    if recipe.get("stage"):
        check_stage(recipe["stage"])
    for key in GENERATION_KEYS:
        if str(recipe.get(key, "")).lower() in ("true", "1"):
            _refuse_generation(key)


def _refuse_generation(key: str) -> None:
    raise UserError(f"{key}=True is not supported with USE_MCA=1: {INSTEAD[key]}. Set {key}: false.")
