"""Multi-token prediction (DeepSeek-V3, GLM-4.5, Qwen3-Next; Qwen3.5 and Qwen3.5-MoE with images and a video): the
MTP loss of our model against one computed from the transformers classes themselves, on one rank and in TP2 + SP, EP2
and PP2 (the MTP layer on the last stage, beside a copy of the embedding; the vision-language models leave it out
there). The round trip of the MTP weights runs in test_bridge and test_multimodal (the tiny models of these families
carry an MTP layer); training with it, the recipe's switch and the merge in test_training and
test_multimodal_training."""

import pytest
import torch

from llamafactory_mca.tools.tiny import TINY, TINY_VL, save_tiny_model
from tests._dist import run_distributed
from tests.models._bridge import hf_tensors
from tests.models._vision import image_and_video_row


FAMILIES = ["deepseek_v3", "glm4_moe", "qwen3_next"]
VL_FAMILIES = ["qwen3_5", "qwen3_5_moe"]
INPUT = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))
LAYOUTS = [("single", {}), ("tp2-sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
           ("ep2", {"expert_model_parallel_size": 2}), ("pp2", {"pipeline_model_parallel_size": 2})]


def _batch(ids: torch.Tensor = INPUT):
    labels = ids.roll(-1, 1)
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[:, -1] = 0  # the last position has no next token
    return labels, mask


def _text_inputs() -> dict:
    return {"input_ids": INPUT, "positions": torch.arange(INPUT.shape[1]).expand_as(INPUT)}


def _vl_inputs(model_dir: str) -> dict:
    """test_multimodal's row (text, two images, a video) with its 3-D positions, as our model takes them."""
    from transformers import AutoConfig as HfConfig

    config = HfConfig.from_pretrained(model_dir)
    inputs = image_and_video_row(config)
    positions, _ = _hf_vl(model_dir).model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        video_grid_thw=inputs["video_grid_thw"])
    keep = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {**{k: inputs[k] for k in keep}, "positions": positions}


def _hf_vl(model_dir: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                       attn_implementation="sdpa").eval()


def _losses(plan: list) -> dict:
    """Per layout and family: (Σ next-token loss, the MTP layer's mean loss) from a training-mode forward through
    Megatron's schedule; None on ranks without the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from llamafactory_mca import parallel
    from llamafactory_mca.args import MegatronArguments
    from llamafactory_mca.models.auto import AutoConfig, AutoModel
    from llamafactory_mca.trainer.loss import lm_loss

    out = {}
    for layout_name, sizes, jobs in plan:
        args = MegatronArguments(**sizes)
        parallel.initialize(parallel.ParallelLayout.from_args(args))
        for name, model_dir, inputs in jobs:
            model = AutoModel.from_config(AutoConfig.from_pretrained(model_dir), args)
            model.load_hf_weights(model_dir)
            model.train()  # the MTP loss is tracked in training mode only; nothing here is random
            (chunk,) = model.chunks
            ids, positions = inputs["input_ids"], inputs["positions"]
            labels, mask = _batch(ids)
            extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "positions")}

            def step(iterator, chunk):
                next(iterator)
                return chunk(ids, positions, None, labels=labels, loss_mask=mask, **extra), partial_loss

            partial_loss = lambda output: lm_loss(mask, output)  # noqa: E731
            MTPLossLoggingHelper.tracker.clear()
            with torch.no_grad():
                logged = get_forward_backward_func()(
                    forward_step_func=step, data_iterator=iter([0]), model=chunk, num_microbatches=1,
                    seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=True)
            last = ps.is_pipeline_last_stage()
            out[(layout_name, name)] = ((logged[0]["loss"][0].item(), MTPLossLoggingHelper.tracker["values"][0].item())
                                        if last else None)
        parallel.destroy_layout()
    return out


def _reference(model_dir: str) -> tuple[float, float]:
    """The next-token loss sum and the MTP loss from transformers' classes: the model proper, and its decoder layer
    class one layer deeper (so transformers itself loads the MTP layer's weights; Qwen3-Next's from ``mtp.layers.0.``
    into a full-attention layer) with enorm, hnorm, eh_proj and shared_head.norm as DeepSeek-V3 defines them
    (Qwen3-Next's pre_fc_norm_embedding, pre_fc_norm_hidden, fc and norm; vLLM's MTP modules compute the same)."""
    from transformers import AutoModelForCausalLM

    from llamafactory_mca.models.auto import AutoConfig
    from llamafactory_mca.models.families import get_family

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    layers = model.config.num_hidden_layers
    prefix = f"model.layers.{layers}."
    deeper = {"num_hidden_layers": layers + 1}
    if getattr(model.config, "layer_types", None):  # a hybrid model's MTP layer is a full-attention one
        deeper |= {"layer_types": [*model.config.layer_types, "full_attention"],
                   "key_mapping": {r"^mtp\.layers\.0\.": prefix}}
    deeper = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                  **deeper).eval()
    weights = {k: v.float() for k, v in hf_tensors(model_dir).items()}
    stored = get_family(model.config.model_type).weight_table(AutoConfig.from_pretrained(model_dir)).stored
    norm = type(model.model.norm)

    def rms(name: str) -> torch.nn.Module:
        module = norm(model.config.hidden_size, eps=model.config.rms_norm_eps)
        module.weight.data.copy_(weights[stored(prefix + name + ".weight")])
        return module

    labels, mask = _batch()
    with torch.no_grad():
        hidden = model.model(INPUT).last_hidden_state  # after the final norm, as Megatron hands it to MTP
        logits = model.lm_head(hidden)
        main = (torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
                * mask.flatten()).sum().item()
        embedded = model.model.embed_tokens(INPUT[:, 1:])  # token i + 1 beside the hidden state of token i
        x = torch.cat([rms("enorm")(embedded), rms("hnorm")(hidden[:, :-1])], dim=-1)
        x = x @ weights[stored(prefix + "eh_proj.weight")].T
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        x = deeper.model.layers[layers](x, position_embeddings=model.model.rotary_emb(x, positions),
                                        position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        mtp_logits = model.lm_head(rms("shared_head.norm")(x))[:, :-1]  # position i predicts token i + 2
        mtp = torch.nn.functional.cross_entropy(mtp_logits.flatten(0, 1), INPUT[:, 2:].flatten()).item()
    return main, mtp


def _reference_vl(model_dir: str) -> tuple[float, float]:
    """As ``_reference``, for Qwen3.5 with images and a video: the MTP layer at position i takes the input embedding
    of position i + 1 as the language model got it (an image's features at its placeholders) and the rotary
    embedding of position i (Megatron's MTP reuses the decoder's); its decoder layer is transformers' full-attention
    layer class, loaded from the checkpoint's ``mtp.layers.0.``."""
    import copy

    model = _hf_vl(model_dir)
    inputs = _vl_inputs(model_dir)
    ids, positions = inputs.pop("input_ids"), inputs.pop("positions")
    lm, text = model.model.language_model, model.config.text_config
    seen = {}
    lm.register_forward_pre_hook(lambda module, args, kwargs: seen.update(embeds=kwargs["inputs_embeds"]),
                                 with_kwargs=True)
    weights = {k: v.float() for k, v in hf_tensors(model_dir).items()}
    deeper = copy.deepcopy(text)
    deeper.num_hidden_layers, deeper.layer_types = text.num_hidden_layers + 1, [*text.layer_types, "full_attention"]
    layer = type(lm.layers[text.layer_types.index("full_attention")])(deeper, text.num_hidden_layers).eval()
    layer.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in weights.items()
                           if k.startswith("mtp.layers.0.")})

    def rms(name: str) -> torch.nn.Module:
        module = type(lm.norm)(text.hidden_size, eps=text.rms_norm_eps)
        module.weight.data.copy_(weights[f"mtp.{name}.weight"])
        return module

    labels, mask = _batch(ids)
    with torch.no_grad():
        out = model.model(input_ids=ids, position_ids=positions, **inputs)
        hidden = out.last_hidden_state
        main = (torch.nn.functional.cross_entropy(model.lm_head(hidden).flatten(0, 1), labels.flatten(),
                                                  reduction="none") * mask.flatten()).sum().item()
        embeds = seen["embeds"]
        assert not torch.equal(embeds, lm.embed_tokens(ids))  # the image features are in
        x = torch.cat([rms("pre_fc_norm_embedding")(embeds[:, 1:]), rms("pre_fc_norm_hidden")(hidden[:, :-1])], -1)
        x = x @ weights["mtp.fc.weight"].T
        x = layer(x, position_embeddings=lm.rotary_emb(x, positions[..., :-1]), attention_mask=None)
        x = x[0] if isinstance(x, tuple) else x
        mtp_logits = model.lm_head(rms("norm")(x))[:, :-1]  # position i predicts token i + 2
        mtp = torch.nn.functional.cross_entropy(mtp_logits.flatten(0, 1), ids[:, 2:].flatten()).item()
    return main, mtp


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {name: save_tiny_model(name, str(root / name)) for name in FAMILIES + VL_FAMILIES}


@pytest.fixture(scope="module")
def losses(tiny):
    """One 4-process run; its "single" layout is DP4, where every rank holds the whole model as one rank would. The
    vision-language models: not under pipelining, EP2 for the MoE one only."""
    inputs = {name: _vl_inputs(tiny[name]) if name in VL_FAMILIES else _text_inputs() for name in tiny}
    runs = lambda layout: [n for n in FAMILIES + VL_FAMILIES  # noqa: E731
                           if n in FAMILIES or (layout != "pp2" and (layout != "ep2" or "moe" in n))]
    plan = [(layout, sizes, [(n, tiny[n], inputs[n]) for n in runs(layout)]) for layout, sizes in LAYOUTS]
    found = {}
    for rank in run_distributed(_losses, 4, plan):
        found.update({key: value for key, value in rank.items() if value is not None})
    return found


def test_packed_roll_is_megatrons():
    """Our sync-free shift of packed sequences (compat.py) against megatron-core's sequence-by-sequence one."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import multi_token_prediction as mtp

    from llamafactory_mca.compat import apply_megatron_fixes, roll_packed_left

    apply_megatron_fixes()
    megatron = mtp._roll_tensor_packed_seq.args[0]
    cu = torch.tensor([0, 5, 6, 13, 20], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for tensor in (torch.arange(1, 21).view(1, 20), torch.rand(1, 20)):
        ours, theirs = roll_packed_left(megatron, tensor, -1, -1, params), megatron(tensor, -1, -1, params)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_tiny_models_carry_an_mtp_layer():
    assert all(TINY[name].get("num_nextn_predict_layers", TINY[name].get("mtp_num_hidden_layers")) == 1
               for name in FAMILIES)
    assert all(TINY_VL[name]["text_config"]["mtp_num_hidden_layers"] == 1 for name in VL_FAMILIES)


@pytest.mark.parametrize("name", FAMILIES + VL_FAMILIES)
def test_mtp_loss_is_the_transformers_layers(name, tiny, losses):
    main, mtp = (_reference_vl if name in VL_FAMILIES else _reference)(tiny[name])
    ours_main, ours_mtp = losses[("single", name)]
    assert abs(ours_main - main) <= 1e-4 * main, (ours_main, main)
    assert abs(ours_mtp - mtp) <= 1e-5 * mtp, (ours_mtp, mtp)


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", [(n, layout) for n in FAMILIES for layout, _ in LAYOUTS[1:]]
                         + [("qwen3_5", "tp2-sp"), ("qwen3_5_moe", "tp2-sp"), ("qwen3_5_moe", "ep2")])
def test_mtp_loss_equal_in_every_layout(name, layout, losses):
    ours_main, ours_mtp = losses[(layout, name)]
    want_main, want_mtp = losses[("single", name)]
    assert abs(ours_main - want_main) <= 1e-5 * want_main and abs(ours_mtp - want_mtp) <= 1e-5 * want_mtp, (
        layout, ours_main, want_main, ours_mtp, want_mtp)
