"""LoRA on Megatron's parallel linears: which modules it adapts (targets.py), the adapters (layers.py), peft's format
(peft_io.py)."""
