"""What a test needs to hold our model against the Hugging Face one: a fixed batch of token ids, full-vocabulary
logits through Megatron's schedule in any layout, and the tensors of a Hugging Face folder.

Shared by the bridge, LoRA, MTP and vision-language tests, the training tests and tests/gpu. A test file imports
helpers from a module like this one, never from another test file: pytest imports a test file under its own name
(``models.test_bridge``), so a second import as ``tests.models.test_bridge`` ran the whole file again.
"""

import os

import torch
from safetensors.torch import load_file


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
