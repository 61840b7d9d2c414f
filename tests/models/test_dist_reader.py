"""DistCheckpointReader: Megatron dist checkpoints saved at TP2, EP2 (fully parallel) and PP2 (layers stacked, and
one key per layer), read back region by region in this plain process (no process group) and compared with what the
ranks held."""

import contextlib
import io
import json
import os
import pickle
import shutil

import pytest
import torch

from llamafactory_mca.checkpoints.dist_reader import DistCheckpointReader
from tests._dist import run_distributed


QKV = "decoder.layers.self_attention.linear_qkv.weight"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
DENSE_FC1 = "decoder.layers.mlp.linear_fc1.weight"
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
OPTIMIZER_STATE = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
MOE_FFN = 8

# name: (tp, pp, ep, etp, num_experts, moe_layer_freq, fully_parallel_save). EP2 needs an even expert count. A
# moe_layer_freq list (a dense first layer) makes Megatron save one key per layer instead of stacking layers.
LAYOUTS = {
    "tp2": (2, 1, 1, 2, 3, 1, False),
    "ep2_fully_parallel": (1, 1, 2, 1, 4, 1, True),
    "pp2": (1, 2, 1, 1, 3, 1, False),
    "pp2_dense_first_layer": (1, 2, 1, 1, 3, [0, 1], False),
}


def _save_layouts(root: str) -> dict:
    """On each rank: build the model per layout, save it, and return its shards and direct parameter checks."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from llamafactory_mca import parallel

    out = {}
    for name, (tp, pp, ep, etp, experts, freq, fully_parallel) in LAYOUTS.items():
        parallel.destroy_layout()
        parallel.initialize(parallel.ParallelLayout(world_size=2, tp=tp, pp=pp, vpp=None, cp=1, ep=ep, etp=etp,
                                                    dp=2 // (tp * pp), expert_dp=2 // (ep * etp * pp),
                                                    micro_batch_size=1, grad_accum=1), seed=11)
        config = TransformerConfig(
            num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=12,
            num_moe_experts=experts, moe_ffn_hidden_size=MOE_FFN, moe_layer_freq=freq, moe_router_topk=2,
            gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm", qk_layernorm=True,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
            gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False)
        if isinstance(freq, list):
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                              pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        else:
            spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=True, normalization="RMSNorm")
        model = GPTModel(config, spec, vocab_size=32, max_sequence_length=8,
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage())
        with torch.no_grad():  # norms start at 1: make every tensor distinct so a misplaced read shows
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        directory = os.path.join(root, name)
        os.makedirs(directory, exist_ok=True)
        torch.distributed.barrier()
        strategy = None
        if fully_parallel:
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
        state = {"model": model.sharded_state_dict(), "iteration": 7}
        if name == "tp2":  # an optimizer state beside the model, as a training checkpoint has
            embedding = model.embedding.word_embeddings.weight.detach().clone()
            rank = parallel_state.get_tensor_model_parallel_rank()
            state["optimizer"] = ShardedTensor.from_rank_offsets(OPTIMIZER_STATE, embedding, (0, rank, tp))
        dist_checkpointing.save(state, directory, sharded_strategy=strategy)

        state = model.sharded_state_dict()
        apply_factories(state)
        shards = [(t.key, t.global_offset, (1,) * t.prepend_axis_num + t.local_shape, tuple(t.global_shape),
                   t.data.detach().clone()) for t in nested_values(state) if isinstance(t, ShardedTensor)]
        out[name] = {"shards": shards, "checks": _module_checks(model, etp)}
    return out


def _module_checks(model, etp: int) -> list:
    """(stacked key, (layer, *index), slices of the read region, expected) straight from the rank's modules."""
    from megatron.core import parallel_state

    tp, etp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank()
    checks = []
    for layer in model.decoder.layers:
        g = layer.layer_number - 1
        qkv, proj = layer.self_attention.linear_qkv.weight.detach(), layer.self_attention.linear_proj.weight.detach()
        rows, cols = qkv.shape[0], proj.shape[1]
        checks += [(QKV, (g,), (slice(tp * rows, (tp + 1) * rows),), qkv.clone()),
                   (PROJ, (g,), (slice(None), slice(tp * cols, (tp + 1) * cols)), proj.clone())]
        if hasattr(layer.mlp, "experts"):
            local = layer.mlp.experts.local_experts
            first = parallel_state.get_expert_model_parallel_rank() * len(local)
            h = MOE_FFN // etp  # a rank holds [gate_r; up_r]; the checkpoint holds [gate; up]
            gate = slice(etp_rank * h, (etp_rank + 1) * h)
            up = slice(MOE_FFN + gate.start, MOE_FFN + gate.stop)
            for j, expert in enumerate(local):
                fc1, fc2 = expert.linear_fc1.weight.detach().clone(), expert.linear_fc2.weight.detach().clone()
                checks += [(FC1, (g, first + j), (gate,), fc1[:h]), (FC1, (g, first + j), (up,), fc1[h:]),
                           (FC2, (g, first + j), (slice(None), gate), fc2)]
        else:
            checks.append((DENSE_FC1, (g,), (), layer.mlp.linear_fc1.weight.detach().clone()))
    return checks


def _stitch(per_rank: list[dict], name: str) -> dict[str, torch.Tensor]:
    """Global tensors assembled from every rank's shards at their global offsets."""
    stitched: dict[str, torch.Tensor] = {}
    for rank in per_rank:
        for key, offset, shape, global_shape, data in rank[name]["shards"]:
            full = stitched.setdefault(key, torch.full(global_shape, float("nan"), dtype=data.dtype))
            region = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
            full[region] = data.reshape(shape)
    for key, full in stitched.items():
        assert not full.isnan().any(), f"the ranks' shards do not cover {key}"
    return stitched


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist_ckpt"))
    per_rank = run_distributed(_save_layouts, 2, root)
    return {name: (os.path.join(root, name), _stitch(per_rank, name), [c for r in per_rank for c in r[name]["checks"]])
            for name in LAYOUTS}


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and torch.equal(actual, expected), what


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_global_tensors_and_regions_match_the_ranks(saved, name):
    path, stitched, checks = saved[name]
    reader = DistCheckpointReader(path)
    assert set(reader.keys()) == set(stitched)
    mlp = "decoder.layers.mlp."
    assert reader.keys(prefix=mlp) == sorted(k for k in stitched if k.startswith(mlp))
    for key, expected in stitched.items():
        assert reader.shape(key) == expected.shape and reader.dtype(key) == expected.dtype, key
        _same(reader.read_full(key), expected, key)
        if expected.dim() < 2:
            continue
        for i in range(expected.shape[0]):  # layers of stacked keys, experts of per-layer ones, rows otherwise
            _same(reader.read(key, (i,)), expected[i], f"{key}[{i}]")
            _same(reader.read(key, i - expected.shape[0]), expected[i], f"{key}[{i - expected.shape[0]}]")
            for j in range(expected.shape[1]) if expected.dim() > 2 else []:  # (layer, expert) or (expert, row)
                _same(reader.read(key, (i, j)), expected[i, j], f"{key}[{i}, {j}]")
                rows = slice(3, expected.shape[2] - 1)  # crosses the gate/up and TP chunk boundaries of fc1
                _same(reader.read(key, (i, j, rows)), expected[i, j, rows], f"{key}[{i}, {j}, 3:-1]")
    per_layer = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert reader.locate_layer(QKV, 1) == ((per_layer, ()) if name == "pp2_dense_first_layer" else (QKV, (1,)))
    for key, (layer, *index), sub, expected in checks:
        _same(reader.read_layer(key, layer, tuple(index))[sub], expected, f"{key} layer {layer} {index} {sub}")
    assert reader.common()["iteration"] == 7


def test_slices_and_bad_indices(saved):
    path, stitched, _ = saved["tp2"]
    reader = DistCheckpointReader(path)
    qkv = stitched[QKV]
    region = (slice(None), slice(10, 20), slice(2, None))  # rows 10:20 span both TP shards
    _same(reader.read(QKV, region), qkv[region], "rows 10:20, cols 2:")
    assert reader.read(QKV, (0, slice(5, 5))).shape == (0, qkv.shape[2])
    with pytest.raises(IndexError):
        reader.read(QKV, (2,))
    with pytest.raises(IndexError):
        reader.read(QKV, (0, 0, 0, 0))
    with pytest.raises(ValueError, match="step"):
        reader.read(QKV, (slice(None, None, 2),))
    with pytest.raises(KeyError, match="no tensor"):
        reader.read("decoder.layers.nothing.weight")
    with pytest.raises(KeyError, match="one key per layer"):
        reader.read_layer("decoder.layers.nothing.weight", 0)
    model_keys = reader.keys()
    assert OPTIMIZER_STATE not in model_keys and reader.keys(optimizer=True) == sorted(model_keys + [OPTIMIZER_STATE])
    assert reader.keys(prefix="optimizer.") == [OPTIMIZER_STATE]
    _same(reader.read(OPTIMIZER_STATE, slice(8, 24)), stitched["embedding.word_embeddings.weight"][8:24], "optimizer")
    with pytest.raises(KeyError, match="an object, not a tensor"):
        reader.read("decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2")


class _RecordingFile(io.RawIOBase):
    """A data file that records which byte ranges were read from it: what a region read really pulls from disk."""

    def __init__(self, f, name, touched):
        self.f, self.name, self.touched = f, name, touched

    def _record(self, start, n):
        if n:
            self.touched.append((self.name, start, start + n))

    def read(self, size=-1):
        start = self.f.tell()
        data = self.f.read(size)
        self._record(start, len(data))
        return data

    def readinto(self, b):
        start = self.f.tell()
        n = self.f.readinto(b)
        self._record(start, n)
        return n

    def seek(self, *args):
        return self.f.seek(*args)

    def tell(self):
        return self.f.tell()

    def readable(self):
        return True

    def seekable(self):
        return True


def _distinct_bytes(ranges):
    covered = set()
    for name, start, end in ranges:
        covered.update((name, i) for i in range(start, end))
    return covered


def test_a_region_reads_only_its_chunks(saved, monkeypatch):
    path, stitched, _ = saved["tp2"]
    reader = DistCheckpointReader(path)
    touched = []
    fs = reader._storage.fs
    original = fs.create_stream

    @contextlib.contextmanager
    def recording_stream(p, mode):
        with original(p, mode) as f:
            yield _RecordingFile(f, os.path.basename(p), touched)

    monkeypatch.setattr(fs, "create_stream", recording_stream)
    assert len(reader.metadata.state_dict_metadata[FC1].chunks) == 2 * 3 * 4  # layers x experts x (gate, up) x TP2
    stored = {tuple(i.offset): info for i, info in reader.metadata.storage_data.items() if i.fqn == FC1}
    mine = _distinct_bytes((info.relative_path, info.offset, info.offset + info.length)
                           for offsets, info in stored.items() if offsets[:2] == (1, 2))

    region = reader.read(FC1, (1, 2))
    _same(region, stitched[FC1][1, 2], "layer 1, expert 2")
    read = _distinct_bytes(touched)
    assert read == mine  # all bytes of its 4 chunks (gate/up x TP2) and nothing else: DCP loads a chunk whole
    assert len(read) * 2 * 3 == sum(info.length for info in stored.values())

    touched.clear()
    for layer in range(2):
        for expert in range(3):
            reader.read(FC1, (layer, expert))
    per_region = _distinct_bytes(touched)
    touched.clear()
    reader.read_full(FC1)
    assert per_region == _distinct_bytes(touched)  # region by region touches what one full read touches


def test_not_a_checkpoint_is_a_clear_error(saved, tmp_path):
    good = saved["tp2"][0]

    def fails(path, match):
        with pytest.raises(ValueError, match=match) as info:
            DistCheckpointReader(str(path))
        assert str(path) in str(info.value)

    fails(tmp_path / "missing", "no such folder")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", "no metadata.json. The folder is empty")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    fails(hf, "Hugging Face model folder")
    parent = tmp_path / "parent"
    shutil.copytree(good, parent / "dist_ckpt")
    fails(parent, "subfolder 'dist_ckpt'")

    def broken(name, edit):
        path = tmp_path / name
        shutil.copytree(good, path)
        edit(path)
        return path

    fails(broken("no_dcp", lambda p: os.remove(p / ".metadata")), "no torch DCP .metadata")
    fails(broken("truncated", lambda p: (p / ".metadata").write_bytes((p / ".metadata").read_bytes()[:200])),
          "truncated or corrupt")
    fails(broken("zarr", lambda p: (p / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))),
          "sharded_backend='zarr'")
    fails(broken("bad_json", lambda p: (p / "metadata.json").write_text("{")), "not a Megatron checkpoint config")
    fails(broken("lost_file", lambda p: os.remove(p / "__1_0.distcp")), "missing: __1_0.distcp")


def test_a_region_no_chunk_covers_is_an_error_not_garbage(saved, tmp_path):
    path = tmp_path / "gap"
    shutil.copytree(saved["tp2"][0], path)
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    chunks = metadata.state_dict_metadata[FC1].chunks
    chunks.remove(next(c for c in chunks if tuple(c.offsets[:2]) == (1, 2)))
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    reader = DistCheckpointReader(str(path))
    _same(reader.read(FC1, (1, 1)), saved["tp2"][1][FC1][1, 1], "an intact region")
    with pytest.raises(ValueError, match=r"does not store all of .*linear_fc1.weight\[\(1, 2\)\]"):
        reader.read(FC1, (1, 2))
