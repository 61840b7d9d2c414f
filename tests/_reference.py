"""Which transformers attention the reference runs for a family (imports nothing heavy: the test helpers that load
at collection use it)."""

import json
import os

from llamafactory_mca.models.reference import EAGER_REFERENCE


def reference_attention(model_dir: str) -> str | None:
    """transformers' attention for the reference logits of the model in ``model_dir`` (None: its default)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return "eager" if json.load(f)["model_type"] in EAGER_REFERENCE else None
