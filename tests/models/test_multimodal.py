"""Vision-language families against ``transformers`` (CPU, fp32): logits on text + image + video input at TP1, TP2 with
sequence parallelism, PP2 (the tower on the first stage only) and, for Qwen3-VL-MoE, Qwen3.5-MoE and GLM-4.5V, EP2;
and the weights' round trip (HF -> Megatron -> HF) bit for bit. (Training through the recipe:
tests/test_multimodal_training.py.)"""


import pytest
import torch

from llamafactory_mca.tools.tiny import save_tiny_model
from tests._dist import run_distributed
from tests.models._bridge import hf_tensors
from tests.models._lora import model_with_adapter
from tests.models._vision import IMAGE_GRID, image_and_video_row


FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v_moe"]


def _hf(model_dir: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(inputs, 3-D positions [3, 1, s], logits) from the HF model."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = image_and_video_row(model.config)
    positions, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                              image_grid_thw=inputs["image_grid_thw"],
                                              video_grid_thw=inputs["video_grid_thw"])
    with torch.no_grad():
        logits = _glm_logits(model, inputs, positions) if model.config.model_type == "glm4v_moe" else \
            model(**inputs).logits
    return inputs, positions, logits


def _glm_logits(model, inputs: dict, positions: torch.Tensor) -> torch.Tensor:
    """transformers' GLM-4.5V forward fills image and video features into one mask (every image token, a video's
    frames' too), so a row with both cannot go through it; its own parts can: each kind's features at its own tokens
    (a video's: between its begin and end ids), then the decoder and the output layer."""
    vlm = model.model
    embeddings = vlm.get_input_embeddings()(inputs["input_ids"])
    images = vlm.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    videos = vlm.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
    types = inputs["mm_token_type_ids"]
    embeddings[types == 1] = torch.cat(images)
    embeddings[types == 2] = torch.cat(videos)
    hidden = vlm.language_model(inputs_embeds=embeddings, position_ids=positions).last_hidden_state
    return model.lm_head(hidden)


LAYOUTS = [("dp2", {}), ("tp2-sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
           ("pp2", {"pipeline_model_parallel_size": 2}), ("ep2", {"expert_model_parallel_size": 2})]
MOE_ONLY = {"ep2"}  # layouts run for the MoE family only


def _logits(model, inputs: dict, positions: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits through Megatron's schedule; None on ranks without them."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def step(iterator, chunk):
        next(iterator)
        out = chunk(inputs["input_ids"], positions, None, pixel_values=inputs["pixel_values"],
                    image_grid_thw=inputs["image_grid_thw"], pixel_values_videos=inputs["pixel_values_videos"],
                    video_grid_thw=inputs["video_grid_thw"])
        return out, lambda out, non_loss_data=True: out

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([None]), model=model.chunks[0], num_microbatches=1,
            seq_length=inputs["input_ids"].shape[1], micro_batch_size=1, forward_only=True, collect_non_loss_data=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(torch.cat(out))
    return logits.clone() if ps.get_tensor_model_parallel_rank() == 0 else None


def _ours(jobs: dict, layouts: list) -> dict:
    """{(family, layout): logits} on the ranks that have them; in the first layout each model is saved back to HF."""

    from llamafactory_mca import parallel
    from llamafactory_mca.args import MegatronArguments
    from llamafactory_mca.models.auto import AutoModel

    found = {}
    for layout, sizes in layouts:
        args = MegatronArguments(**sizes)
        parallel.initialize(parallel.ParallelLayout.from_args(args))
        for name, (model_dir, inputs, positions, back_dir) in jobs.items():
            if layout in MOE_ONLY and "moe" not in name:
                continue
            model = AutoModel.from_pretrained(model_dir, args).eval()
            logits = _logits(model, inputs, positions)
            if logits is not None:
                found[(name, layout)] = logits
            if layout == layouts[0][0]:
                model.save_pretrained(back_dir)
        parallel.destroy_layout()
    return found


def test_vision_language_logits_and_round_trip_match_transformers(tmp_path):
    """Every family, at DP2 (each rank the whole model), TP2 + SP and PP2 (the tower on the first stage only), in
    one two-process run."""
    jobs, expected = {}, {}
    for name in FAMILIES:
        model_dir = save_tiny_model(name, str(tmp_path / name))
        inputs, positions, expected[name] = _hf(model_dir)
        assert positions[1:].ne(positions[0]).any()  # the image tokens' rows differ: 3-D positions are exercised
        jobs[name] = (model_dir, inputs, positions, str(tmp_path / f"{name}-back"))
    found = {k: v for rank in run_distributed(_ours, 2, jobs, LAYOUTS) for k, v in rank.items()}
    assert sorted(found) == sorted((n, layout) for n in FAMILIES for layout, _ in LAYOUTS
                                   if layout not in MOE_ONLY or "moe" in n), found.keys()
    for (name, layout), logits in found.items():
        logits = logits[..., : expected[name].shape[-1]]
        assert torch.allclose(logits, expected[name], atol=1e-4), (name, layout, (logits - expected[name]).abs().max())
    for name, (model_dir, _, _, back_dir) in jobs.items():
        original, back = hf_tensors(model_dir), hf_tensors(back_dir)
        assert sorted(original) == sorted(back) and any("visual." in k for k in back)
        assert any(k.startswith("mtp.") for k in back) == name.startswith("qwen3_5"), name  # Qwen3.5's MTP layer
        for key in original:
            # transformers saves stacked experts as it holds them ([E, out, in]); we write the hub's: Qwen3-VL-MoE's
            # [E, in, out], Qwen3.5-MoE's [E, out, in]
            hub_in_out = ".mlp.experts." in key and name == "qwen3_vl_moe"
            expected = original[key].transpose(1, 2) if hub_in_out else original[key]
            assert torch.equal(expected, back[key]), (name, key)


def test_what_vision_language_training_cannot_do_yet_is_refused(tmp_path):
    from types import SimpleNamespace

    from llamafactory_mca.errors import UserError
    from llamafactory_mca.models.auto import AutoConfig
    from llamafactory_mca.plan import check_model_fits, plan_mtp

    config = AutoConfig.from_pretrained(save_tiny_model("qwen2_vl", str(tmp_path / "hf")))
    layout = SimpleNamespace(cp=1, pp=1, vpp=None)
    for stage in ("sft", "dpo", "kto"):
        check_model_fits(config, stage, layout)
    with pytest.raises(UserError, match="stage rm on vision-language models is not supported"):
        check_model_fits(config, "rm", layout)
    with pytest.raises(UserError, match="context_parallel_size=2 is not supported"):
        check_model_fits(config, "sft", SimpleNamespace(cp=2, pp=1, vpp=None))
    # Qwen3-VL: decoder layers 0 and 1 take deepstack features, so they must sit with the tower
    config = AutoConfig.from_pretrained(save_tiny_model("qwen3_vl", str(tmp_path / "hf3")))
    check_model_fits(config, "sft", SimpleNamespace(cp=1, pp=2, vpp=None))
    with pytest.raises(UserError, match=r"first 2 decoder layers take .* deepstack .* pipeline_model_parallel_size=2 "
                                        r"x virtual_pipeline_model_parallel_size=2 puts 1 layers there"):
        check_model_fits(config, "sft", SimpleNamespace(cp=1, pp=2, vpp=2))
    # with a pipeline_model_parallel_layout the user places the layers; the model build checks where they went
    check_model_fits(config, "sft", SimpleNamespace(cp=1, pp=2, vpp=2), custom_pipeline_layout=True)
    # Qwen3.5's MTP layer takes the image features: trained without pipelining, left out with it (refused if asked)
    config = AutoConfig.from_pretrained(save_tiny_model("qwen3_5", str(tmp_path / "hf35")))
    run = lambda pp, mtp=None: SimpleNamespace(pipeline_model_parallel_size=pp, mtp_num_layers=mtp)  # noqa: E731
    assert plan_mtp(config, "sft", "full", run(1)) == (config, None)
    planned, note = plan_mtp(config, "sft", "full", run(2))
    assert planned.mtp_num_layers == 0 and "pipeline_model_parallel_size: 1 trains it" in note
    assert plan_mtp(config, "sft", "full", run(2, 0))[0].mtp_num_layers == 0
    planned, note = plan_mtp(config, "dpo", "full", run(1))
    assert planned.mtp_num_layers == 0 and "not trained in a dpo run" in note
    with pytest.raises(UserError, match=r"qwen3_5: the multi-token-prediction layer takes the image features, .* "
                                        r"\(pipeline_model_parallel_size=2\)\. Set pipeline_model_parallel_size: 1"):
        plan_mtp(config, "sft", "full", run(2, 1))


def _lora_logits(model_dir: str, adapter: str, inputs: dict, positions: torch.Tensor, layouts: list) -> dict:
    from llamafactory_mca import parallel
    from llamafactory_mca.args import MegatronArguments

    found = {}
    for layout, sizes in layouts:
        args = MegatronArguments(**sizes)
        parallel.initialize(parallel.ParallelLayout.from_args(args))
        model, _ = model_with_adapter(model_dir, adapter, args)
        logits = _logits(model.eval(), inputs, positions)
        if logits is not None:
            found[layout] = logits
        parallel.destroy_layout()
    return found


def test_qwen3_5_lora_gives_peft_logits_with_images(tmp_path):
    """LoRA on Qwen3.5's gated delta-rule projections (flat in_proj_qkv / z / b; in_proj_a left out, so its rows of
    the fused adapter are zero), its gated attention and MLP, with images and a video: peft's logits at DP2, and at
    TP2 + SP without in_proj_qkv, which holds q, k and v of every head in turn and is refused under TP. The first
    adapter names its modules as LLaMA-Factory's default path does for a VL model: in full, the tower's left out."""
    from llamafactory.hparams import FinetuningArguments
    from llamafactory.model.model_utils.visual import patch_target_modules
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForImageTextToText

    model_dir = save_tiny_model("qwen3_5", str(tmp_path / "model"))
    inputs, positions, _ = _hf(model_dir)
    adapters, expected = {}, {}
    for name, targets in {"all": ["in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "q_proj", "o_proj",
                                  "down_proj"],
                          "no_qkv": ["in_proj_z", "in_proj_b", "out_proj", "v_proj", "gate_proj"]}.items():
        torch.manual_seed(1)
        hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        if name == "all":
            targets = patch_target_modules(hf, FinetuningArguments(finetuning_type="lora"), targets)
            assert all(".layers." in target for target in targets)
        peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for param_name, param in peft.named_parameters():
                if "lora_" in param_name:
                    param.mul_(0.3)
        adapters[name] = str(tmp_path / name)
        peft.save_pretrained(adapters[name])
        reference = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=torch.float32), adapters[name]).eval()
        with torch.no_grad():
            expected[name] = reference(**inputs).logits
    ranks = run_distributed(_lora_logits, 2, model_dir, adapters["all"], inputs, positions, [("dp2", {})])
    ranks += run_distributed(_lora_logits, 2, model_dir, adapters["no_qkv"], inputs, positions,
                             [("tp2-sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True})])
    found = {("all" if "dp2" in r else "no_qkv"): v for rank in ranks for r, v in rank.items()}
    assert set(found) == {"all", "no_qkv"}
    for name, logits in found.items():
        logits = logits[..., : expected[name].shape[-1]]
        assert (logits - expected[name]).abs().max().item() <= 1e-4, name

    from llamafactory_mca.errors import UserError
    from llamafactory_mca.models.auto import AutoConfig
    from llamafactory_mca.models.lora.peft_io import plan_lora

    config = AutoConfig.from_pretrained(model_dir)
    everything = FinetuningArguments(finetuning_type="lora", lora_target="all")
    plan_lora(config, everything, [], 1, tensor_parallel=1)
    with pytest.raises(UserError, match=r"LoRA on \['in_proj_qkv'\] needs tensor_model_parallel_size: 1 \(it is 2\)"):
        plan_lora(config, everything, [], 1, tensor_parallel=2)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v_moe"])
def test_vision_towers_attend_in_one_call_per_block(name, monkeypatch):
    """The towers' attention goes through ours, one call per block with the pieces' cu_seqlens (Qwen2.5-VL: its
    windows in the windowed blocks), and on CPUs gives transformers' own SDPA tower bit for bit (tests/gpu: the
    varlen kernel against it in bf16)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from llamafactory_mca.models.multimodal import build_vision_tower
    from llamafactory_mca.models.native import tower_attention
    from llamafactory_mca.tools.tiny import tiny_hf_config

    hf = tiny_hf_config(name)
    torch.manual_seed(0)
    ours = build_vision_tower(hf.to_dict(), torch.float32).eval()
    theirs = type(ours)._from_config(hf.vision_config, dtype=torch.float32, attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    calls = []

    def counted(module, query, *args, **kwargs):
        calls.append(kwargs.get("cu_seq_lens_q"))
        return tower_attention.tower_attention(module, query, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, tower_attention.ATTENTION, counted)
    row = image_and_video_row(hf)
    with torch.no_grad():
        mine = ours(row["pixel_values"], grid_thw=IMAGE_GRID)
        reference = theirs(row["pixel_values"], grid_thw=IMAGE_GRID)
    mine, reference = (getattr(out, "pooler_output", out) for out in (mine, reference))
    assert torch.equal(mine, reference)
    assert len(calls) == hf.vision_config.depth and all(cu is not None and cu[0] == 0 for cu in calls)
    assert calls[0][-1] == int(IMAGE_GRID.prod(-1).sum())  # every patch, packed

