"""Megatron dist checkpoint → Hugging Face safetensors, one tensor group at a time, in one CPU process.

The streaming primitive is ``iter_hf_tensors``: a generator of ``(hf_name, tensor)`` that reads one
layer (or one expert) region of one global tensor, turns it back into HF tensors with the family's
ops, and forgets it. ``export_hf`` consumes it (the merge command, the trainer's exports and
``McaModel.save_pretrained`` all call that), so a model larger than host memory can be merged.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator

import torch

from ..checkpoints import config_file, dist_checkpoint_dir, verify_checkpoint
from ..checkpoints.dist_reader import DistCheckpointReader
from ..checkpoints.hf_io import ShardedWriter, copy_side_files, move_into, write_hf_config
from ..errors import UserError
from .config import McaConfig
from .families import get_family
from .loading import dims_for
from .mapping import fill, is_mtp_only, split_expert, stored_mtp_name, te_norm_name
from .value_head import write_file as write_value_head


def stored_keys(pattern: str) -> list[str]:
    """Dist-checkpoint keys a canonical pattern may be stored under (layers/experts become tensor axes; the TE
    spec keeps layer norms under its fused linears' names)."""
    key = pattern.replace("decoder.layers.*.", "decoder.layers.").replace(
        ".mlp.experts.local_experts.*.", ".mlp.experts.experts.")
    return _with_te_norm(key)


def _with_te_norm(key: str) -> list[str]:
    stored = te_norm_name(key)
    return [key] if stored == key else [key, stored]


_LAYERS = "decoder.layers.*."


def _index_ranges(pattern: str, config: McaConfig, reader: DistCheckpointReader | None = None
                  ) -> list[tuple[int, ...]]:
    """The indices a canonical pattern takes: decoder layers (and experts) from the config; anything else (a vision
    tower's blocks) from the keys the checkpoint (``reader``) holds."""
    stars = pattern.count("*")
    if stars == 0:
        return [()]
    if not pattern.startswith(_LAYERS):
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")
        return sorted(tuple(map(int, m.groups())) for key in reader.keys() if (m := regex.match(key)))
    first = config.num_layers if is_mtp_only(pattern) else 0  # multi-token prediction's parts: its layers only
    layers = [i for i in range(first, config.num_layers_with_mtp) if config.holds(pattern, i)]
    if stars == 1:
        return [(i,) for i in layers]
    return [(i, e) for i in layers for e in range(config.num_experts or 0)]


def iter_hf_tensors(reader: DistCheckpointReader, config: McaConfig, dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) for every exported HF tensor, layer by layer, reading one region at a time."""
    table = get_family(config).weight_table(config)
    dims = dims_for(config, 1)
    ops = [op for op in table.ops if op.export]
    # Tensors outside the decoder layers first, then each layer's together (one layer's group in memory at a time).
    order = [(op, idx) for op in ops if not op.mca.startswith(_LAYERS)
             for idx in _index_ranges(op.mca, config, reader)]
    for layer in range(config.num_layers_with_mtp):
        for op in ops:
            if op.mca.startswith(_LAYERS):
                order += [(op, idx) for idx in _index_ranges(op.mca, config, reader) if idx[0] == layer]
    stacking: dict[str, list[torch.Tensor]] = {}  # HF tensors that stack a layer's experts, until complete
    for op, index in order:
        tensor = read_tensor(reader, op.mca, index, config)
        mapped = table.at(op, index)
        for pattern, hf_tensor in zip(mapped.hf, mapped.to_hf(tensor, dims)):
            name = fill(pattern, index[: pattern.count("*")])
            hf_tensor = hf_tensor if dtype is None else hf_tensor.to(dtype)
            base, expert = split_expert(name)
            if expert is None:
                yield table.stored(name), hf_tensor
                continue
            stacking.setdefault(base, []).append(hf_tensor)
            if len(stacking[base]) == config.num_experts:
                yield table.stored(base), torch.stack(stacking.pop(base))


def read_tensor(reader: DistCheckpointReader, pattern: str, index: tuple[int, ...], config: McaConfig) -> torch.Tensor:
    """One canonical tensor (a layer's, an expert's) from wherever the checkpoint stored it."""
    if index and pattern.startswith(_LAYERS) and index[0] >= config.num_layers:  # a multi-token-prediction layer
        layer = stored_mtp_name(pattern.replace("*", str(index[0]), 1), config.num_layers)
        for key in _with_te_norm(layer.replace(".mlp.experts.local_experts.*.", ".mlp.experts.experts.")):
            if key in reader:
                return reader.read(key, index[1:])
    for key in stored_keys(pattern):
        if not index or not pattern.startswith(_LAYERS):
            if fill(key, index) in reader:
                return reader.read(fill(key, index))
            continue
        found = reader.locate_layer(key, index[0])  # layers stacked on axis 0, or one key per layer
        if found is not None:
            return reader.read(found[0], (*found[1], *index[1:]))
    raise UserError(f"the checkpoint at {reader.path} has no tensor for {pattern} (looked for "
                     f"{stored_keys(pattern)}); was it written by llamafactory_mca for a {config.hf_model_type} "
                     "model?")


def export_hf(checkpoint: str, output: str, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 1024**3) -> dict:
    """Write HF safetensors, config.json and tokenizer files for the checkpoint at ``checkpoint``.

    The checkpoint is verified before anything is written, and the files are written into a temporary sibling
    folder that moves into ``output`` only when complete: a failed merge leaves no output folder behind (and an
    existing one as it was).
    """
    start = time.perf_counter()
    verify_checkpoint(checkpoint)
    config = McaConfig.from_json_file(config_file(checkpoint))
    reader = DistCheckpointReader(dist_checkpoint_dir(checkpoint))
    staging = f"{os.path.abspath(output)}.tmp-{os.getpid()}"
    try:
        writer = ShardedWriter(staging, max_shard_bytes)
        stored_dtype = None
        for name, tensor in iter_hf_tensors(reader, config, dtype):
            stored_dtype = stored_dtype or tensor.dtype
            writer.add(name, tensor)
        writer.finish()
        write_hf_config(config.hf_config, staging, dtype or stored_dtype)
        write_value_head(reader, staging, dtype)  # a reward model's, as LLaMA-Factory writes it
        copied = copy_side_files(checkpoint, staging)
        move_into(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"bytes": writer.total_bytes, "seconds": time.perf_counter() - start, "side_files": copied}
