"""LoRA on Megatron's parallel linears (layers.py) and in peft's format (peft_io.py)."""
