"""Every supported family, imported explicitly so the registry is complete after one import."""

from . import llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe  # noqa: F401
