"""LLaVA's layout against ``transformers`` (CPU, fp32): Gemma 3 with images (a SigLIP encoder and a pooling projector,
image tokens that see their whole image), InternVL 3.5 (InternViT, whose class token the projector drops and whose
patches it folds 2 x 2, on Qwen3's decoder with its own output layer, and on gpt-oss's: sinks, windows shorter than the
rows, YaRN, biased experts) and Gemma 4 (images of their own sizes as patches with their positions, pooled 2 x 2; image
tokens that see their whole image on the windowed layers only).
Logits of a padded row and of a pack of two sequences at DP2, TP2 with sequence parallelism and PP2 (and EP2 where the
decoder has experts); another
checkpoint's spelling of the prefixes (Gemma 3's hub files, InternVL's in-memory names) read as transformers' own;
the round trip bit for bit. (Training through the
recipe: tests/test_multimodal_training.py.)"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from llamafactory_mca.tools.tiny import TINY, model_type_of, save_tiny_model
from tests._dist import run_distributed
from tests.models._bridge import hf_tensors, save_mxfp4_experts


LAYOUTS = [("dp2", {}), ("tp2-sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
           ("pp2", {"pipeline_model_parallel_size": 2})]
MORE_LAYOUTS = {"internvl_gpt_oss": [("ep2", {"expert_model_parallel_size": 2})]}  # its experts split over the ranks


def _rows(config) -> list[dict]:
    """Two sequences: text, an image, text, a second image right after a short text, text; and one with an image at
    its very start. Each image is an opening token, its tokens, a closing token (plain text ids here: Gemma 3's config
    names its own, InternVL's does not). Gemma 4's images are patches with their (x, y), of their own sizes: 4 x 4
    patches (4 tokens, pooled 2 x 2), 4 x 2 (2 tokens) and 2 x 4, padded to 20 patches."""
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(0, 190, (n,), generator=g)  # noqa: E731
    image_id = getattr(config, "image_token_index", None) or config.image_token_id
    image = lambda tokens: torch.tensor([190, *[image_id] * tokens, 191])  # noqa: E731
    if config.model_type == "gemma4":
        grids = [(4, 4), (4, 2), (2, 4)]
        sizes = [w * h // config.vision_config.pooling_kernel_size ** 2 for w, h in grids]
        patch = 3 * config.vision_config.patch_size ** 2
        positions = [torch.stack(torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy"), -1).reshape(-1, 2)
                     for w, h in grids]
        vision = [{"pixel_values": torch.randn(20, patch, generator=g),
                   "image_position_ids": torch.cat([p, torch.full((20 - len(p), 2), -1)])} for p in positions]
        for one, p in zip(vision, positions):
            one["pixel_values"][len(p):] = 0  # the processor's padding
    else:
        tokens = getattr(config, "mm_tokens_per_image", None) or config.image_seq_length
        sizes = [tokens] * 3
        size = config.vision_config.image_size
        size = size[0] if isinstance(size, list) else size
        vision = [{"pixel_values": torch.randn(3, size, size, generator=g)} for _ in sizes]
    first = torch.cat([text(5), image(sizes[0]), text(1), image(sizes[1]), text(6)])
    second = torch.cat([text(1), image(sizes[2]), text(9)])
    return [{"input_ids": ids.view(1, -1), **{k: torch.stack([v[k] for v in images]) for k in images[0]}}
            for ids, images in ((first, vision[:2]), (second, vision[2:]))]


def _hf_logits(model_dir: str) -> tuple[list[dict], list[torch.Tensor]]:
    from transformers import AutoModelForImageTextToText

    # .float(): an MXFP4 checkpoint's experts load dequantized to bf16 whatever dtype is asked
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).float().eval()
    rows = _rows(model.config)
    extra = lambda row: {}  # noqa: E731
    if model.config.model_type == "gemma3":  # what LLaMA-Factory's collator gives, and what turns the look-ahead on
        extra = lambda row: {"token_type_ids": (row["input_ids"] == model.config.image_token_index).long()}  # noqa: E731
    if model.config.model_type == "gemma4":  # (its look-ahead: on the windowed layers)
        extra = lambda row: {"mm_token_type_ids": (row["input_ids"] == model.config.image_token_id).long()}  # noqa: E731
    with torch.no_grad():
        logits = [model(**row, **extra(row)).logits[0] for row in rows]
    return rows, logits


def _forward(model, ids: torch.Tensor, positions: torch.Tensor, vision: dict, params) -> torch.Tensor | None:
    """Full-vocabulary logits [s, v] through Megatron's schedule; None on ranks without them."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def step(iterator, chunk):
        next(iterator)
        return chunk(ids, positions, None, **vision, packed_seq_params=params), lambda out, **_: out

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([None]), model=model.chunks[0], num_microbatches=1,
            seq_length=ids.shape[1], micro_batch_size=1, forward_only=True, collect_non_loss_data=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(torch.cat(out))
    return logits[0].clone() if ps.get_tensor_model_parallel_rank() == 0 else None


def _ours(model_dirs: dict, rows: list[dict], back_dir: str, layouts: list) -> dict:
    """{(checkpoint, layout, padded | packed): logits} on the ranks that have them; the first layout saves back."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from llamafactory_mca import parallel
    from llamafactory_mca.args import MegatronArguments
    from llamafactory_mca.models.auto import AutoModel

    first = rows[0]["input_ids"]
    pack = torch.cat([row["input_ids"] for row in rows], dim=1)
    lengths = [row["input_ids"].shape[1] for row in rows]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    pack_positions = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    keys = [k for k in rows[0] if k != "input_ids"]
    first_vision, pack_vision = {k: rows[0][k] for k in keys}, {k: torch.cat([row[k] for row in rows]) for k in keys}
    found = {}
    for layout, sizes in layouts:
        args = MegatronArguments(**sizes)
        parallel.initialize(parallel.ParallelLayout.from_args(args))
        for name, model_dir in model_dirs.items():
            model = AutoModel.from_pretrained(model_dir, args).eval()
            for batch, (ids, positions, vision, packed) in {
                    "padded": (first, torch.arange(first.shape[1]).view(1, -1), first_vision, None),
                    "packed": (pack, pack_positions, pack_vision, params)}.items():
                logits = _forward(model, ids, positions, vision, packed)
                if logits is not None:
                    found[(name, layout, batch)] = logits
            if layout == layouts[0][0]:
                model.save_pretrained(os.path.join(back_dir, name))
        parallel.destroy_layout()
    return found


# Another checkpoint's spelling of the prefixes transformers writes: Gemma 3's hub files nest the encoder deeper;
# InternVL's may hold transformers' in-memory names
OTHER_PREFIXES = {"gemma3": {"vision_tower.": "vision_tower.vision_model."},
                  "internvl": {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
                               "vision_tower.": "model.vision_tower.",
                               "multi_modal_projector.": "model.multi_modal_projector."}}


def _renamed(name: str, prefixes: dict[str, str]) -> str:
    return next((other + name[len(ours):] for ours, other in prefixes.items() if name.startswith(ours)), name)


def _as_another_checkpoint_spells_it(model_dir: str, hub_dir: str, family: str) -> str:
    """The same model under ``OTHER_PREFIXES``."""
    os.makedirs(hub_dir)
    for file in os.listdir(model_dir):
        if file != "model.safetensors":
            with open(os.path.join(model_dir, file), "rb") as src, open(os.path.join(hub_dir, file), "wb") as dst:
                dst.write(src.read())
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    renamed = {_renamed(k, OTHER_PREFIXES[family]): v for k, v in tensors.items()}
    assert sorted(renamed) != sorted(tensors)
    save_file(renamed, os.path.join(hub_dir, "model.safetensors"), metadata={"format": "pt"})
    return hub_dir


# The hub's InternVL3.5-GPT-OSS checkpoint keeps gpt-oss's experts in MXFP4 (quantization_config at the top level):
# its "hub" copy here is so, on experts whose width is a multiple of MXFP4's 32-value blocks
MXFP4 = {"internvl_gpt_oss": dict(text_config=dict(TINY["gpt_oss"], model_type="gpt_oss", intermediate_size=96))}


@pytest.mark.parametrize("family", ["gemma3", "internvl", "internvl_gpt_oss", "gemma4"])
def test_llava_layout_logits_and_round_trip_match_transformers(tmp_path, family):
    model_dir = save_tiny_model(family, str(tmp_path / family), **MXFP4.get(family, {}))
    dirs = {"transformers": model_dir}
    if model_type_of(family) in OTHER_PREFIXES:
        dirs["hub"] = _as_another_checkpoint_spells_it(model_dir, str(tmp_path / "hub"), model_type_of(family))
    if family in MXFP4:
        save_mxfp4_experts(dirs["hub"])
    expected = {name: _hf_logits(path) for name, path in dirs.items()}
    rows = expected["transformers"][0]
    back_dir = str(tmp_path / "back")
    layouts = LAYOUTS + MORE_LAYOUTS.get(family, [])
    found = {k: v for rank in run_distributed(_ours, 2, dirs, rows, back_dir, layouts) for k, v in rank.items()}
    assert sorted(found) == sorted((n, layout, b) for n in dirs for layout, _ in layouts for b in ("padded", "packed"))
    vocab = expected["transformers"][1][0].shape[-1]
    for (name, layout, batch), logits in found.items():
        want = expected[name][1][0] if batch == "padded" else torch.cat(expected[name][1])
        diff = (logits[:, :vocab] - want).abs().max()
        assert diff < 1e-4, (name, layout, batch, diff)
    if family in MXFP4:  # exported as plain weights, which transformers loads as they are
        hub_back = os.path.join(back_dir, "hub")
        with open(os.path.join(hub_back, "config.json"), encoding="utf-8") as f:
            assert "quantization_config" not in json.dumps(json.load(f))
        assert not any(k.endswith(("_blocks", "_scales")) for k in hf_tensors(hub_back))
        for want, got in zip(expected["hub"][1], _hf_logits(hub_back)[1]):
            assert torch.allclose(got, want, atol=1e-5)
    original, back = hf_tensors(model_dir), hf_tensors(os.path.join(back_dir, "transformers"))
    towers = (".vision_tower.encoder.", ".model.vision_tower.encoder.")  # Gemma 4's under model.
    assert sorted(original) == sorted(back) and any(f".{k}".startswith(towers) for k in back)
    assert ("language_model.lm_head.weight" in back) == (model_type_of(family) == "internvl")  # Gemma 3 ties it
    for key in original:
        assert torch.equal(original[key], back[key]), key
