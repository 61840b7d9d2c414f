"""peft adapters for tests: one made by peft itself (random, so it changes the logits), and our model with one on it.

Shared by the LoRA parity tests, the vision-language tests and the layouts walk, which all hold our LoRA against
peft's. peft, transformers and our model code are imported in the functions, as in the test files: the layouts walk
imports this module at collection and needs none of them until it runs.
"""

import torch

from tests._reference import reference_attention


EXPERT_PARAMS = ["experts.gate_up_proj", "experts.down_proj"]  # peft's target_parameters for the routed experts


def hf_causal_lm(model_dir: str):
    """The HF model of a checkpoint: its causal LM, or a vision-language model whole."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = hasattr(AutoConfig.from_pretrained(model_dir), "vision_config")
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    attention = reference_attention(model_dir)
    return auto.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention).eval()


def make_peft_adapter(model_dir: str, out_dir: str, targets: list[str], experts: bool,
                      modules_to_save: list[str] | None = None, seed: int = 1) -> str:
    """A peft LoRA adapter with random A *and* B (so it changes the logits), saved as peft saves it; modules to save
    are changed too."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                        target_parameters=EXPERT_PARAMS if experts else None, modules_to_save=modules_to_save)
    model = get_peft_model(hf_causal_lm(model_dir), config)
    with torch.no_grad():  # peft's non-default init is large; keep the logits in a sane range
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(0.3)
            elif "modules_to_save" in name:
                param.mul_(1.5)
    model.save_pretrained(out_dir)
    return out_dir


def model_with_adapter(model_dir: str, adapter: str, args):
    """Our model of ``model_dir`` in the current layout with peft's ``adapter`` on it, as a LoRA run resumes one."""
    from llamafactory_mca.models.auto import AutoModel
    from llamafactory_mca.models.lora.layers import apply_lora
    from llamafactory_mca.models.lora.peft_io import load_adapter, read_adapter_config
    from llamafactory_mca.models.lora.targets import LoraSettings

    model = AutoModel.from_pretrained(model_dir, args)
    run = apply_lora(model, LoraSettings.from_peft(read_adapter_config(adapter)))
    load_adapter(model, adapter)
    return model, run
