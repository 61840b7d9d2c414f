"""What a test needs to hold our model against the Hugging Face one: a fixed batch of token ids, full-vocabulary
logits through Megatron's schedule in any layout, the tensors of a Hugging Face folder, and a tiny gpt-oss folder's
experts rewritten as the hub's MXFP4.

Shared by the bridge, LoRA, MTP and vision-language tests, the training tests and tests/gpu. A test file imports
helpers from a module like this one, never from another test file: pytest imports a test file under its own name
(``models.test_bridge``), so a second import as ``tests.models.test_bridge`` ran the whole file again.
"""

import json
import os

import torch
from safetensors.torch import load_file, save_file


INPUT = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))


def hf_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    files = [f for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


def pipeline_logits(model, ids: torch.Tensor):
    """Full-vocabulary logits through Megatron's schedule (any PP/VPP/TP); None on ranks without the output."""
    # Megatron is imported here, in the ranks that run this: the training tests import this module for INPUT alone
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    chunks = model.chunks
    # the interleaved schedule needs at least pp micro-batches: one row each
    micro = list(ids.split(1)) if len(chunks) > 1 else [ids]
    positions = torch.arange(ids.shape[1]).expand_as(micro[0])

    def step(iterator, chunk):
        tokens = next(iterator)
        return chunk(tokens, positions, None), lambda out, non_loss_data=True: out

    iterators = [iter(micro) for _ in chunks]
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(micro), seq_length=ids.shape[1],
            micro_batch_size=micro[0].shape[0], forward_only=True, collect_non_loss_data=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(torch.cat(out))
    return logits.clone() if ps.get_tensor_model_parallel_rank() == 0 else None  # padded vocabulary included


def save_mxfp4_experts(directory: str) -> str:
    """Rewrite a tiny gpt-oss model's experts as the hub stores gpt-oss's: MXFP4, each block of 32 input values as
    4-bit e2m1 codes (two a byte, the even value in the low nibble: ``<name>_blocks`` [E, out, in / 32, 16]) and one
    power-of-two scale (``<name>_scales`` [E, out, in / 32], exponent + 127), with config.json's quantization_config.
    The values become the nearest representable ones; transformers and we both read them back dequantized."""
    from transformers.integrations.mxfp4 import FP4_VALUES  # here: only gpt-oss (MXFP4) models need it

    path = os.path.join(directory, "model.safetensors")
    tensors, codes = load_file(path), torch.tensor(FP4_VALUES)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).float().transpose(1, 2)  # [E, in, out] -> [E, out, in]
        blocks = weight.reshape(*weight.shape[:2], -1, 32)
        exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=1e-30) / 6.0))
        index = ((blocks / torch.exp2(exponent)[..., None])[..., None] - codes).abs().argmin(-1).to(torch.uint8)
        tensors[f"{name}_blocks"] = (index[..., 0::2] | (index[..., 1::2] << 4)).contiguous()
        tensors[f"{name}_scales"] = (exponent + 127).to(torch.uint8).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return directory
