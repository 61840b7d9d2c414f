"""``cuda_graphs: true``: every layer replayed as a CUDA graph needs every micro-batch described by the same shapes.

On CPUs the graphs themselves do not run, but the shapes they need do: packs of one size, ``cu_seqlens`` lengthened
to a fixed number of sequences with empty ones, ``max_seqlen`` one past the pack. These tests check that those shapes
train exactly what the plain path trains, through the real command, and that what graphs cannot replay is refused
before any worker starts. ``tests/gpu/test_cuda_graphs_gpu.py`` runs the graphs on a GPU against eager layers.
"""

import numpy as np
import pytest
from torch import nn

from llamafactory_mca.data.batch import MicroBatch
from llamafactory_mca.data.packing import collate_packed
from llamafactory_mca.data.rows import Sample
from llamafactory_mca.models.native.rope import thd_positions
from llamafactory_mca.tools.tiny import save_tiny_model, save_tiny_tokenizer
from llamafactory_mca.trainer.graphs import eager_layers
from tests._cli import losses, ok, one_error, recipe, train


def _pack(lengths: list[int], total: int) -> MicroBatch:
    samples = [Sample(sequences=[(np.arange(1, n + 1), np.arange(2, n + 2))]) for n in lengths]
    return collate_packed(samples, pad_multiple=1, pad_token_id=0, total_length=total)


def test_slots_add_empty_sequences_and_keep_every_position():
    batch = _pack([5, 3, 4], total=16)
    fixed = batch.with_slots(6)
    assert fixed.cu_seqlens.tolist() == [0, 5, 8, 16, 16, 16, 16]
    assert fixed.max_seqlen == 17 and fixed.tokens.shape == batch.tokens.shape
    # RoPE's positions restart at every real sequence and ignore the empty ones
    assert thd_positions(fixed.cu_seqlens, 16, 1, 0, absolute=False).tolist() == batch.position_ids[0].tolist()
    assert fixed.seqlens == batch.seqlens  # FLOPs count the real sequences
    with pytest.raises(ValueError, match="at most 2 sequences"):
        batch.with_slots(2)


def test_graphs_are_set_aside_for_forward_only_runs_and_put_back():
    layer, other = nn.Linear(2, 2), nn.Linear(2, 2)
    layer.cudagraph_manager = nn.Module()  # what megatron-core's local graphs attach to each layer
    manager = layer.cudagraph_manager
    chunk = nn.Sequential(layer, other)
    with eager_layers([chunk]):
        assert not hasattr(layer, "cudagraph_manager") and not hasattr(other, "cudagraph_manager")
    assert layer.cudagraph_manager is manager and not hasattr(other, "cudagraph_manager")


@pytest.mark.parametrize("tuning", [{}, dict(finetuning_type="lora", lora_target="all")])
def test_fixed_shapes_train_what_the_plain_path_trains(tuning, assets, tmp_path):
    runs = {}
    for graphs in (False, True):
        name = f"graphs_{graphs}"
        config = recipe(assets, tmp_path / name, sequence_packing=True, cuda_graphs=graphs, max_steps=3,
                        eval_dataset="tiny_alpaca", eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2,
                        **tuning)
        result, output = train(tmp_path, config, name=name)
        ok(result, output)
        runs[graphs] = losses(tmp_path / name)
        if graphs:
            assert "cuda_graphs: true on CPUs" in output and "eval loss" in output
    assert runs[True].keys() == runs[False].keys() == {1, 2, 3}
    for step, loss in runs[False].items():
        assert runs[True][step] == pytest.approx(loss, rel=1e-5), (step, runs)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(pipeline_model_parallel_size=2), "pipeline_model_parallel_size: 1"),
    (dict(recompute_granularity="full"), "recompute_granularity: selective"),
    (dict(sequence_packing=False), "packing: true"),
    (dict(finetuning_type="lora", lora_target="all", lora_dropout=0.1), "lora_dropout: 0"),
    (dict(model="qwen3_moe"), "moe_grouped_gemm: true"),
    (dict(model="qwen3_moe", moe_grouped_gemm=True, expert_model_parallel_size=2), "expert_model_parallel_size: 1"),
    (dict(model="qwen3_next", moe_grouped_gemm=True), "without linear-attention layers"),
])
def test_what_graphs_cannot_replay_is_refused_before_any_worker(overrides, fragment, assets, tmp_path):
    overrides = dict(overrides)
    name = overrides.pop("model", "qwen3")
    model = assets["models"].get(name)
    if model is None:  # a family the shared assets do not have
        model = save_tiny_model(name, str(tmp_path / name), vocab_size=assets["vocab"])
        save_tiny_tokenizer(model)
    config = recipe(assets, tmp_path / "out", model_name_or_path=model,
                    **{"sequence_packing": True, "cuda_graphs": True, **overrides})
    result, output = train(tmp_path, config, world=2, alone=False)
    one_error(result, output, "cuda_graphs=True needs", fragment)
    assert not (tmp_path / "out").exists()
