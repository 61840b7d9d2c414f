"""HF ⇄ Megatron-Core bridge: parity per family, every layout, round trips, streaming reads, clear errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from llamafactory_mca.tools.tiny import TINY, save_tiny_model, tiny_hf_config
from tests._dist import run_distributed
from tests._reference import reference_attention
from tests.models._bridge import INPUT, hf_tensors, pipeline_logits, save_mxfp4_experts


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hf_logits(model_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=reference_attention(model_dir)).eval()
    with torch.no_grad():
        return model(INPUT).logits


def _run_layouts(plan: list[tuple[str, dict, list[tuple[str, str, str]]]]) -> dict:
    """In each rank, layout after layout (process groups rebuilt in between): build every (family, model_dir,
    work_dir) job, return logits and read stats, and where a job has a work_dir save HF weights (save_pretrained) and
    a dist checkpoint for its round trip. One process group for all layouts: spawning and importing per layout costs
    minutes in CI."""
    from megatron.core import parallel_state as ps

    from llamafactory_mca import parallel
    from llamafactory_mca.args import MegatronArguments
    from llamafactory_mca.checkpoints import SideFiles, write_folder
    from llamafactory_mca.models.auto import AutoConfig, AutoModel

    results = {}
    for layout_name, sizes, jobs in plan:
        args = MegatronArguments(**sizes)
        args.gradient_accumulation_steps = args.pipeline_model_parallel_size  # micro-batches per forward (VPP: pp)
        layout = parallel.ParallelLayout.from_args(args)
        parallel.initialize(layout)
        for name, model_dir, work_dir in jobs:
            model = AutoModel.from_config(AutoConfig.from_pretrained(model_dir), args)
            source = model.load_hf_weights(model_dir)
            model.eval()
            logits = pipeline_logits(model, INPUT)
            if work_dir is not None:
                model.save_pretrained(os.path.join(work_dir, "hf"))
                write_folder(os.path.join(work_dir, "ckpt"), model.sharded_state_dict(),
                             SideFiles(model.config, layout))
            results[(layout_name, name)] = {"logits": logits, "bytes_read": source.bytes_read,
                                            "files": source.files_opened, "dp_rank": ps.get_data_parallel_rank()}
        parallel.destroy_layout()
    return results


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: save_tiny_model(name, str(root / name)) for name in TINY}


@pytest.fixture(scope="module")
def single_rank(tiny_models):
    jobs = [(name, path, None) for name, path in tiny_models.items()]  # logits only
    (results,) = run_distributed(_run_layouts, 1, [("single", {}, jobs)])
    return {name: results[("single", name)]["logits"] for name in tiny_models}


@pytest.mark.parametrize("name", list(TINY))
def test_parity_with_transformers(name, tiny_models, single_rank):
    reference = _hf_logits(tiny_models[name])
    vocab = reference.shape[-1]
    diff = (single_rank[name][..., :vocab] - reference).abs().max().item()
    assert diff <= 1e-4, f"{name}: max |HF - MCore| = {diff}"
    # the padded vocabulary rows never take part in the softmax: the loss is Hugging Face's
    assert torch.isneginf(single_rank[name][..., vocab:]).all()
    targets = INPUT.roll(-1, 1)
    ours = torch.nn.functional.cross_entropy(single_rank[name].flatten(0, 1), targets.flatten())
    theirs = torch.nn.functional.cross_entropy(reference.flatten(0, 1), targets.flatten())
    assert abs(ours.item() - theirs.item()) <= 1e-5


LAYOUTS = {  # all run in one 4-process world (dp = 4 / model-parallel size)
    # qwen3_next first: its round trip runs here (the delta-rule layers' per-key-head rows split over TP)
    # (minimax_m2: its q/k norms' statistics summed over the TP ranks' heads)
    "tp2": ({"tensor_model_parallel_size": 2}, ["qwen3_next", "qwen3", "qwen2_moe", "mixtral", "llama3_tied",
                                                 "mistral", "glm4_moe", "deepseek_v3", "gpt_oss", "minimax_m2",
                                                 "glm_moe_dsa", "gemma4_text", "gemma4_text_e2b"]),
    # glm4_moe first: its round trip runs here (layer 0 dense, on stage 0 only)
    "pp2": ({"pipeline_model_parallel_size": 2}, ["glm4_moe", "llama3_tied", "qwen3_moe", "qwen3_next", "qwen2",
                                                  "gemma3_text", "gpt_oss", "minimax_m2", "glm_moe_dsa"]),
    # qwen3_next first: its round trip runs here (its layer pattern, delta rule, attention, delta rule, attention,
    # cut into four virtual stages; the MTP layer with the last)
    "pp2_vpp2": ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
                 ["qwen3_next", "qwen2", "gemma3_text"]),
    # gemma3_text first: its round trip runs here (the post-sublayer norms on sequence-parallel slices)
    # (glm_moe_dsa: the sparse attention's indexer on the whole sequence, gathered from the SP slices)
    "tp2_sp": ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, ["gemma3_text", "glm_moe_dsa"]),
    "ep2": ({"expert_model_parallel_size": 2}, ["qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "qwen3_next",
                                                "gpt_oss", "minimax_m2", "glm_moe_dsa", "gemma4_text_moe"]),
    # gpt_oss first: its round trip runs here (the grouped experts' biases, each rank's two experts)
    "ep2_grouped": ({"expert_model_parallel_size": 2, "moe_grouped_gemm": True}, ["gpt_oss", "qwen2_moe"]),
    "ep2_etp2": ({"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2}, ["qwen3_moe", "glm4_moe",
                                                                                       "deepseek_v3"]),
    # glm_moe_dsa first: its round trip runs here (multi-latent attention split over TP, its RoPE rows interleaved,
    # the indexer whole on each TP rank, the dense layer on stage 0, the MTP layer on stage 1)
    "tp2_pp2": ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, ["glm_moe_dsa", "deepseek_v3",
                                                                                      "llama", "qwen3_moe"]),
    # gemma4_text's round trip: its full-attention layers' own shapes (checkpointed per layer), each stage's layer
    # scalars, the values' norm and the soft-capped logits on sequence-parallel slices
    "tp2_pp2_sp": ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True},
                   ["gemma4_text"]),
    # minimax_m2's round trip: the q/k norms' weights whole on both TP ranks, the correction bias on the MoE block
    "tp2_ep2": ({"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}, ["minimax_m2"]),
    # gemma4_text_moe's round trip: the MoE block's norms and router scales beside experts split over EP, the dense
    # MLP over TP, on sequence-parallel slices
    "tp2_ep2_sp": ({"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": True},
                   ["gemma4_text_moe"]),
    # uneven virtual stages placed by hand: the dense layer alone with the embedding, the MTP layer alone with the loss
    "pp2_layout": ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|tt|t|mL"},
                   ["deepseek_v3", "glm4_moe"]),
}
WORLD = 4


@pytest.fixture(scope="module")
def layouts(tiny_models, tmp_path_factory):
    plan = []
    for layout, (sizes, names) in LAYOUTS.items():
        work = tmp_path_factory.mktemp(layout)
        # saved for the round trip only by the layout's first family (test_round_trip_is_bit_identical)
        plan.append((layout, sizes, [(name, tiny_models[name], str(work / name) if name == names[0] else None)
                                     for name in names]))
    per_rank = run_distributed(_run_layouts, WORLD, plan)
    out = {}
    for layout, _, jobs in plan:
        for name, _, work_dir in jobs:
            found = [r[(layout, name)] for r in per_rank]
            first_replica = [f for f in found if f["dp_rank"] == 0]
            out[(layout, name)] = {"logits": next(f["logits"] for f in found if f["logits"] is not None),
                                   "work": work_dir, "bytes": [f["bytes_read"] for f in first_replica],
                                   "files": [f["files"] for f in first_replica]}
    return out


ALL_LAYOUT_JOBS = [(layout, name) for layout, (_, names) in LAYOUTS.items() for name in names]


@pytest.mark.slow
@pytest.mark.parametrize("layout,name", ALL_LAYOUT_JOBS)
def test_layout_logits_equal_single_rank(layout, name, layouts, single_rank):
    got, want = layouts[(layout, name)]["logits"], single_rank[name]
    vocab = TINY[name]["vocab_size"]
    diff = (got[..., :vocab] - want[..., :vocab]).abs().max().item()
    assert diff <= 1e-5, f"{layout}/{name}: max |layout - single rank| = {diff}"


def _assert_same_weights(exported_dir: str, source_dir: str) -> None:
    exported, source = hf_tensors(exported_dir), hf_tensors(source_dir)
    assert set(exported) == set(source), (set(exported) ^ set(source))
    for key, tensor in source.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key


@pytest.mark.slow
@pytest.mark.parametrize("layout,name", [(layout, names[0]) for layout, (_, names) in LAYOUTS.items()])
def test_round_trip_is_bit_identical(layout, name, layouts, tiny_models):

    work = layouts[(layout, name)]["work"]
    _assert_same_weights(os.path.join(work, "hf"), tiny_models[name])  # through save_pretrained
    merged = os.path.join(work, "merged")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path",
                             os.path.join(work, "ckpt"), "--output_path", merged], capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_weights(merged, tiny_models[name])  # through a dist checkpoint and megatron_merge.py
    with torch.no_grad():
        assert torch.allclose(_hf_logits(merged), _hf_logits(tiny_models[name]), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma4", "gemma4_e2b"])
def test_gemma4_as_the_hub_stores_it_trains_its_text_and_carries_its_tower(name, tmp_path):
    """Gemma 4's hub layout (``gemma4``: the decoder under model.language_model., a vision tower and its embedder
    beside it): text logits equal transformers' at DP2, TP2 + SP and PP2, and every tensor, the tower's and the
    embedder's too, comes back bit for bit through save_pretrained and megatron_merge. The E2B/E4B (per-layer inputs,
    layers attending with earlier layers' keys and values, an audio tower carried along, untouched): the same at DP2
    and TP2 + SP; they refuse pipelining (below)."""
    family = name
    model = save_tiny_model(family, str(tmp_path / family))
    sizes = [("dp2", {}), ("tp2_sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True})]
    if family == "gemma4":
        sizes.append(("pp2", {"pipeline_model_parallel_size": 2}))
    plan = [(name, layout, [(family, model, str(tmp_path / name) if name == "tp2_sp" else None)])
            for name, layout in sizes]
    per_rank = run_distributed(_run_layouts, 2, plan)
    reference = _hf_logits(model)
    for name, _, _ in plan:
        got = next(r[(name, family)]["logits"] for r in per_rank if r[(name, family)]["logits"] is not None)
        assert (got[..., :reference.shape[-1]] - reference).abs().max().item() <= 1e-4, name
    _assert_same_weights(str(tmp_path / "tp2_sp" / "hf"), model)
    merged = str(tmp_path / "merged")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path",
                             str(tmp_path / "tp2_sp" / "ckpt"), "--output_path", merged], capture_output=True,
                            text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_weights(merged, model)


@pytest.mark.slow
def test_each_rank_reads_only_its_slices(layouts, tiny_models):
    """TP2: each rank reads about half of the weights (norms and the router are replicated)."""
    total = sum(t.numel() * t.element_size() for t in hf_tensors(tiny_models["qwen3"]).values())
    per_rank = layouts[("tp2", "qwen3")]["bytes"]
    for read in per_rank:
        assert read < 0.56 * total, (read, total)
    assert total <= sum(per_rank) < 1.1 * total
    # PP2: a stage opens the file but reads only its own layers
    pp = layouts[("pp2", "qwen3_moe")]["bytes"]
    moe_total = sum(t.numel() * t.element_size() for t in hf_tensors(tiny_models["qwen3_moe"]).values())
    assert all(read < 0.75 * moe_total for read in pp), (pp, moe_total)


# ---- clear errors --------------------------------------------------------------------------------------------------


def _layout(**sizes):
    from llamafactory_mca.parallel import ParallelLayout

    base = dict(world_size=8, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=1, expert_dp=1, micro_batch_size=1,
                grad_accum=1)
    return ParallelLayout(**{**base, **sizes})


@pytest.mark.parametrize("name,sizes,message", [
    ("qwen3", {"tp": 8}, "does not divide num_attention_heads=4"),
    ("qwen3", {"tp": 4}, "does not divide the key/value heads"),
    ("gemma4_text", {"tp": 4}, r"does not divide the full-attention layers' key/value heads \(num_global_key_value"),
    ("llama_odd_ffn", {"tp": 2}, "does not divide ffn_hidden_size=93"),
    ("glm4_moe_odd_ffn", {"tp": 2}, "does not divide ffn_hidden_size=93"),  # its dense first layer's MLP
    ("mixtral", {"ep": 2}, "expert_model_parallel_size=2 does not divide num_experts=3"),
    ("qwen3_moe", {"etp": 3}, "expert_tensor_parallel_size=3 does not divide moe_ffn_hidden_size=32"),
    ("llama", {"pp": 8}, "8 stages is more than num_layers=4"),
    ("llama", {"pp": 3}, "does not split evenly"),
    ("qwen3_next", {"cp": 2}, "context_parallel_size=2: the gated delta-rule layers cannot split a sequence"),
    ("glm_moe_dsa", {"cp": 2}, "context_parallel_size=2: DeepSeek sparse attention's indexer ranks every earlier key"),
    ("gemma4_text_e2b", {"pp": 2}, "pipeline_model_parallel_size=2: the per-layer inputs and shared keys and values"),
])
def test_layout_errors_name_the_sizes(name, sizes, message, tiny_models, tmp_path):
    from llamafactory_mca.models.auto import AutoConfig
    from llamafactory_mca.parallel import check_layout

    path = tiny_models.get(name) or save_tiny_model(name.removesuffix("_odd_ffn"), str(tmp_path / name),
                                                    intermediate_size=93)
    with pytest.raises(ValueError, match=message):
        check_layout(AutoConfig.from_pretrained(path), _layout(**sizes))


def test_lora_on_hybrid_models_passes_the_preflight_and_refuses_dropout_on_the_shared_gate(tiny_models):
    """``lora_target: all`` on Qwen3-Next takes every projection and the shared expert's gate, whose adapter is folded
    into its weight: lora_dropout is refused there, naming it."""
    from llamafactory.hparams import FinetuningArguments

    from llamafactory_mca.errors import UserError
    from llamafactory_mca.models.auto import AutoConfig
    from llamafactory_mca.models.lora.peft_io import plan_lora

    config = AutoConfig.from_pretrained(tiny_models["qwen3_next"])
    plan_lora(config, FinetuningArguments(finetuning_type="lora", lora_target="all"), [], 1, 2)
    with pytest.raises(UserError, match=r"lora_dropout=0.1 with LoRA on \['shared_expert_gate'\]"):
        plan_lora(config, FinetuningArguments(finetuning_type="lora", lora_target="all", lora_dropout=0.1),
                        [], 1)


def test_unsupported_models_fail_with_the_supported_list(tmp_path):
    from transformers import GPT2Config, LlamaConfig

    from llamafactory_mca.models.auto import AutoConfig
    from llamafactory_mca.models.families import get_family

    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="not supported by llamafactory_mca; supported: deepseek_v3, gemma3, "
                                         "gemma3_text, gemma4, gemma4_text, glm4_moe, glm4v_moe, glm_moe_dsa, "
                                         "gpt_oss, internvl, llama"):
        AutoConfig.from_pretrained(str(tmp_path / "gpt2"))
    # Gemma 4: bidirectional attention between all tokens; keys and values shared from a kind of layer no earlier
    # layer is
    tiny_hf_config("gemma4_text", use_bidirectional_attention="all").save_pretrained(tmp_path / "all")
    with pytest.raises(ValueError, match=r"gemma4_text: use_bidirectional_attention='all' \(bidirectional attention "
                                         "between all tokens"):
        AutoConfig.from_pretrained(str(tmp_path / "all"))
    tiny_hf_config("gemma4_text_e2b", num_kv_shared_layers=5).save_pretrained(tmp_path / "shared")
    with pytest.raises(ValueError, match=r"gemma4_text: num_kv_shared_layers=5 \(the first 1 layers hold no "
                                         r"\['full_attention'\] layer"):
        AutoConfig.from_pretrained(str(tmp_path / "shared"))
    LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=256).save_pretrained(
        tmp_path / "dynamic")
    with pytest.raises(ValueError, match="rope scaling 'dynamic' is not supported.*supported: default, linear, "
                                         "llama3, yarn"):
        AutoConfig.from_pretrained(str(tmp_path / "dynamic"))
    LlamaConfig(attention_bias=True).save_pretrained(tmp_path / "bias")
    with pytest.raises(ValueError, match="attention_bias=True"):
        AutoConfig.from_pretrained(str(tmp_path / "bias"))
    # sigmoid routing Megatron cannot reproduce

    tiny_hf_config("glm4_moe", norm_topk_prob=False).save_pretrained(tmp_path / "glm")
    with pytest.raises(ValueError, match="norm_topk_prob=False with sigmoid routing"):
        AutoConfig.from_pretrained(str(tmp_path / "glm"))
    # InternVL on a decoder it is not declared with (InternVL 3.5 30B-A3B's)
    moe = dict(tiny_hf_config("qwen3_moe").to_dict(), model_type="qwen3_moe")
    tiny_hf_config("internvl", text_config=moe).save_pretrained(tmp_path / "internvl_moe")
    with pytest.raises(ValueError, match="internvl: a qwen3_moe decoder \\(text_config.model_type\\) is not supported "
                                         "by llamafactory_mca. Supported: gpt_oss, qwen3."):
        AutoConfig.from_pretrained(str(tmp_path / "internvl_moe"))
    # its family by the model_type alone (InternVL on Qwen3, the first declared) refuses the other decoder's config
    with pytest.raises(ValueError, match="internvl: the family of its qwen3 decoder was handed a gpt_oss decoder's"):
        get_family("internvl").config_from_hf(tiny_hf_config("internvl_gpt_oss"))
    # InternVL on gpt-oss: a quantization other than the hub's MXFP4 experts, at its top level, is refused; MXFP4 said
    # in its text half is dropped from the exported config as it is from the top level (tests/models/
    # test_llava_vision.py loads an MXFP4 one)
    bnb = tiny_hf_config("internvl_gpt_oss")
    bnb.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match="internvl: a bitsandbytes quantized checkpoint is not supported"):
        get_family(bnb).config_from_hf(bnb)
    text = dict(tiny_hf_config("gpt_oss").to_dict(), quantization_config={"quant_method": "mxfp4"})
    mxfp4 = tiny_hf_config("internvl_gpt_oss", text_config=text)
    assert "quantization_config" not in json.dumps(get_family(mxfp4).config_from_hf(mxfp4).hf_config)
    # GLM-5 variants the sparse attention does not implement
    for name, overrides, message in [
            ("shared", {"indexer_types": ["full", "shared", "full", "shared"]},
             "indexer_types=.*reusing the previous layer's keys.*an indexer of its own in every layer"),
            ("yarn", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 128}}, "Supported: plain RoPE"),
            ("interleaved", {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
             "Supported: the dense layers first, then MoE ones")]:
        tiny_hf_config("glm_moe_dsa", **overrides).save_pretrained(tmp_path / name)
        with pytest.raises(ValueError, match=message):
            AutoConfig.from_pretrained(str(tmp_path / name))


# DeepSeek-V3's routing where megatron-core scores a group unlike transformers: 8 experts in 4 groups, the best 2
# groups, top-2 experts (megatron-core: a group's best 2 // 2 = 1 expert; transformers: its best 2)
GROUPED = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)


def test_grouped_routing_scores_groups_as_transformers():
    from megatron.core.transformer.moe import moe_utils
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from llamafactory_mca.models.native import install
    from llamafactory_mca.models.native.routing import MEGATRON_GROUP_LIMITED_TOPK, group_limited_topk

    install()
    assert moe_utils.group_limited_topk is group_limited_topk
    torch.manual_seed(0)
    hf = DeepseekV3MoE(DeepseekV3Config(hidden_size=16, moe_intermediate_size=8, n_shared_experts=1,
                                        routed_scaling_factor=1.0, norm_topk_prob=True, **GROUPED))
    hf.gate.e_score_correction_bias.zero_()
    logits = torch.randn(512, 8)
    theirs, _ = hf.route_tokens_to_experts(logits)
    _, ours = group_limited_topk(logits.sigmoid(), 2, 512, 8, 4, 2)
    assert torch.equal(ours.sort(dim=-1).values, theirs.sort(dim=-1).values)
    _, megatron = MEGATRON_GROUP_LIMITED_TOPK(logits.sigmoid(), 2, 512, 8, 4, 2)  # its own choice: other experts
    assert (megatron.sort(dim=-1).values != ours.sort(dim=-1).values).any(dim=-1).float().mean() > 0.1


@pytest.mark.slow
def test_grouped_routing_logits_equal_transformers_in_every_layout(tmp_path):
    """The tiny DeepSeek-V3 with the routing above: logits equal transformers' at one rank, TP2, PP2 and EP2."""
    model = save_tiny_model("deepseek_v3", str(tmp_path / "model"), **GROUPED)
    plan = [(layout, sizes, [("grouped", model, str(tmp_path / layout))]) for layout, sizes in (
        ("single", {}), ("tp2", {"tensor_model_parallel_size": 2}), ("pp2", {"pipeline_model_parallel_size": 2}),
        ("ep2", {"expert_model_parallel_size": 2}))]
    per_rank = run_distributed(_run_layouts, WORLD, plan)
    reference = _hf_logits(model)
    vocab = reference.shape[-1]
    for layout, _, _ in plan:
        got = next(r[(layout, "grouped")]["logits"] for r in per_rank if r[(layout, "grouped")]["logits"] is not None)
        diff = (got[..., :vocab] - reference).abs().max().item()
        assert diff <= 1e-4, f"{layout}: max |HF - MCore| = {diff}"


def test_missing_and_truncated_safetensors_are_named(tiny_models, tmp_path):
    import shutil

    from llamafactory_mca.checkpoints.hf_io import SafetensorsSource

    with pytest.raises(ValueError, match="holds no Hugging Face safetensors"):
        SafetensorsSource(str(tmp_path))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["llama"], broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        SafetensorsSource(str(broken))
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="listed in model.safetensors.index.json but missing"):
        SafetensorsSource(str(missing)).get("model.norm.weight")


@pytest.mark.slow
def test_convert_pre_shards_and_merges_back(tiny_models, tmp_path):
    """``llamafactory-mca convert`` (TP2, started as two processes by itself) writes a dist checkpoint that the
    merge turns back into the same Hugging Face weights."""
    converted, merged = tmp_path / "converted", tmp_path / "merged"
    result = subprocess.run(["llamafactory-mca", "convert", "--hf_path", tiny_models["qwen3"], "--output_path",
                             str(converted), "--tensor_model_parallel_size", "2"], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (converted / "mca_config.json").is_file() and (converted / "dist_ckpt" / "metadata.json").is_file()
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), str(converted),
                             str(merged), "--tensor_model_parallel_size", "2"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_weights(str(merged), tiny_models["qwen3"])
    contradiction = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"),
                                    str(converted), str(tmp_path / "again"), "--tensor_model_parallel_size", "4"],
                                   capture_output=True, text=True, timeout=300)
    assert contradiction.returncode != 0
    assert "--tensor_model_parallel_size=4 contradicts the checkpoint" in contradiction.stderr


def test_merge_refuses_a_folder_that_is_not_a_checkpoint(tiny_models, tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path",
                             tiny_models["llama"], "--output_path", str(tmp_path / "out")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0
    assert "is not a llamafactory_mca checkpoint" in result.stderr


def test_every_hf_key_maps_exactly_once(tiny_models):
    """Per family: the weight table covers every key of the HF checkpoint once, and nothing more (a stacked tensor's
    experts once each: its name once, from expert 0)."""
    from llamafactory_mca.models.auto import AutoConfig
    from llamafactory_mca.models.export import _index_ranges
    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.models.mapping import fill, split_expert

    for name, path in tiny_models.items():
        config = AutoConfig.from_pretrained(path)
        table = get_family(config.hf_model_type).weight_table(config)
        covered = []
        for op in table.ops:
            for index in _index_ranges(op.mca, config):
                mapped = table.at(op, index)  # the layer's own (Gemma 4's full-attention layers: no v_proj)
                covered += [table.stored(fill(p, index[: p.count("*")])) for p in mapped.hf if op.export]
        covered = [name for name, expert in map(split_expert, covered) if expert in (None, 0)]  # stacked: once
        assert len(covered) == len(set(covered)), name
        assert set(covered) == set(hf_tensors(path)), (name, set(covered) ^ set(hf_tensors(path)))


def test_parameter_count_is_the_hf_models(tiny_models):
    """The startup summary's parameter count (and so its memory estimate) is the HF model's, per family: dense and MoE
    layers mixed (glm4_moe's first layer is dense), shared experts, biases, qk-norms, tied embeddings."""
    from transformers import AutoModelForCausalLM

    from llamafactory_mca.models.auto import AutoConfig
    from llamafactory_mca.models.cost import model_parameter_count

    for name, path in tiny_models.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        # transformers drops the multi-token-prediction layer (deepseek_v3, glm4_moe; qwen3_next's under mtp.): its
        # tensors counted from the file, less its copies of the embedding and output layer and its correction bias
        layer, not_counted = (f"model.layers.{hf.config.num_hidden_layers}.", "mtp."), (
            "embed_tokens.weight", "shared_head.head.weight", "e_score_correction_bias")
        mtp = sum(t.numel() for key, t in hf_tensors(path).items()
                  if key.startswith(layer) and not key.endswith(not_counted))
        assert model_parameter_count(AutoConfig.from_pretrained(path)) == hf.num_parameters() + mtp, name


def test_mxfp4_checkpoint_loads_dequantized_and_exports_plain_weights(tmp_path):
    """A gpt-oss checkpoint with its experts in MXFP4, as the hub stores gpt-oss: our logits equal transformers' on the
    same checkpoint (it dequantizes to bf16 on a CPU; its experts run here in fp32 on those values), and the export
    is plain weights, the dequantized values exactly, with no quantization_config: transformers loads it as is."""
    from transformers import AutoModelForCausalLM

    model = save_mxfp4_experts(save_tiny_model("gpt_oss", str(tmp_path / "mxfp4"), intermediate_size=96))
    (results,) = run_distributed(_run_layouts, 1, [("single", {}, [("gpt_oss", model, str(tmp_path / "work"))])])
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).float().eval()
    with torch.no_grad():
        reference = hf(INPUT).logits
    diff = (results[("single", "gpt_oss")]["logits"][..., :reference.shape[-1]] - reference).abs().max().item()
    assert diff <= 1e-4, diff
    exported = os.path.join(tmp_path, "work", "hf")
    with open(os.path.join(exported, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    tensors = hf_tensors(exported)
    assert not any(name.endswith(("_blocks", "_scales")) for name in tensors)
    dequantized = hf.model.layers[1].mlp.experts.down_proj
    assert torch.equal(tensors["model.layers.1.mlp.experts.down_proj"].float(), dequantized)
    plain = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(plain(INPUT).logits, reference, atol=1e-5)
