"""Version workarounds for Megatron-Core, gated on what is installed; nothing else patches upstream.

Each fix names the version it was seen in and the condition it is applied under, so it can be
dropped when that version is no longer supported.
"""

from __future__ import annotations

import importlib.util
from functools import cache

from packaging.version import Version


@cache
def has_transformer_engine() -> bool:
    """True when Transformer Engine's PyTorch bindings import (not merely a stub on the path)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def megatron_version() -> Version:
    from megatron.core.package_info import __version__

    return Version(__version__)


_APPLIED = False


def apply_megatron_fixes() -> None:
    """Apply once per process, before any model is built."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.x: without TE the router's `router_gating_linear` reads a module-level
    # `te_general_gemm` that was never defined (NameError on GPU as well as CPU).
    if not has_transformer_engine() and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
