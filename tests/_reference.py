"""Which transformers attention the reference runs for a family (imports nothing heavy: the test helpers that load
at collection use it)."""

import json
import os


# Families whose reference is transformers' eager attention: gpt-oss's default path loads a FlashAttention-3 kernel
# from the hub (no network here, no such GPU kernel on CPU; eager has the sinks); GLM-5's SDPA path drops the causal
# mask when no row is padded (its sparse-attention mask replaces SDPA's is_causal), so a query sees later tokens.
EAGER_REFERENCE = ("gpt_oss", "glm_moe_dsa")


def reference_attention(model_dir: str) -> str | None:
    """transformers' attention for the reference logits of the model in ``model_dir`` (None: its default)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return "eager" if json.load(f)["model_type"] in EAGER_REFERENCE else None
