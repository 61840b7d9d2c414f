"""LoRA adapters are peft's: an adapter peft made (random, non-zero) loads into our model in every layout and gives
peft's logits; our checkpoint of it exports back to the same tensors, which peft loads; the trainable parameters are
peft's for the same ``lora_target`` (``all`` as LLaMA-Factory expands it, a list, and the routed experts)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from llamafactory_mca.models.families import get_family
from llamafactory_mca.tools.tiny import model_type_of, save_tiny_model
from tests._dist import run_distributed
from tests.models._bridge import INPUT, pipeline_logits
from tests.models._lora import EXPERT_PARAMS, hf_causal_lm, make_peft_adapter, model_with_adapter


# family: (lora_target as peft sees it, experts too, modules_to_save = LLaMA-Factory's additional_target)
ADAPTERS = {"qwen3": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False,
                      ["lm_head"]),
            "qwen3_moe": (["q_proj", "v_proj", "o_proj"], True, None),
            # layer 0 dense, later layers' MLP projections are the shared experts'; q/k/v carry biases
            "glm4_moe": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True, None),
            # multi-latent attention's low-rank projections (TP splits their outputs; MLA gathers the latents)
            "deepseek_v3": (["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj"], False,
                            None),
            # the same with GLM-5's sparse attention: q_b_proj's and kv_a_proj_with_mqa's RoPE rows interleaved for
            # Megatron, their adapters' rows too
            "glm_moe_dsa": (["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "down_proj"], False,
                            None),
            # gated delta-rule layers (in_proj fused from qkvz and ba, grouped per key head; ba left out here, so its
            # rows of the fused adapter are zero) and gated attention ([q | gate] per head); the shared expert's MLP
            # and its gate
            "qwen3_next": (["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "out_proj", "gate_proj",
                            "down_proj", "shared_expert_gate"], False, None),
            # o_proj's and down_proj's adapters feed the norms on the sublayers' outputs (Gemma's sandwich norms)
            "gemma3_text": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False,
                            None),
            # Gemma 4: the full-attention layers' q_proj, k_proj and o_proj are wider and they have no v_proj (the
            # keys are the values), so each layer has adapters of its own shapes
            "gemma4_text": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], False, None),
            # Gemma 4's MoE block: the dense MLP beside the experts, and the router's projection (a linear in HF:
            # its adapter folded into Megatron's router weight)
            "gemma4_text_moe": (["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "proj"], True, None),
            # Gemma 4's E2B/E4B: the per-layer inputs' linears in every layer and the model's projection into them
            # (outside the layers); the last layers have q_proj only (they attend with earlier layers' keys and
            # values) and a double-wide MLP
            "gemma4_text_e2b": (["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "per_layer_input_gate",
                                 "per_layer_projection", "per_layer_model_projection"], False, None),
            # every attention projection carries a bias beside its adapter (the experts are 3-D parameters, which
            # LLaMA-Factory's lora_target: all leaves out)
            "gpt_oss": (["q_proj", "k_proj", "v_proj", "o_proj"], False, None),
            # the q/k norms across all heads follow q_proj's and k_proj's adapters; Mixtral's expert layout
            "minimax_m2": (["q_proj", "k_proj", "v_proj", "o_proj"], True, None)}
UNPIPELINED = ("gemma4_text_e2b",)  # refuses pipelining (its per-layer inputs and shared keys and values)
LAYOUTS = [("dp2", {}), ("tp2-sp", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
           ("pp2", {"pipeline_model_parallel_size": 2}), ("ep2", {"expert_model_parallel_size": 2}),
           ("ep2-grouped", {"expert_model_parallel_size": 2, "moe_grouped_gemm": True}),
           ("tp2-grouped", {"tensor_model_parallel_size": 2, "moe_grouped_gemm": True})]
pytestmark = pytest.mark.filterwarnings("ignore:Unsupported layer type")


def peft_logits(model_dir: str, adapter: str) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_causal_lm(model_dir), adapter).eval()
    with torch.no_grad():
        return model(INPUT).logits


def _in_layouts(models: dict, adapters: dict, layouts: list, work: str) -> dict:

    from llamafactory_mca import parallel
    from llamafactory_mca.args import MegatronArguments
    from llamafactory_mca.checkpoints import SideFiles, write_folder
    from llamafactory_mca.models.lora.peft_io import export_adapter, peft_config

    results = {}
    for layout_name, sizes in layouts:
        args = MegatronArguments(**sizes)
        args.gradient_accumulation_steps = args.pipeline_model_parallel_size
        layout = parallel.ParallelLayout.from_args(args)
        parallel.initialize(layout)
        for name, model_dir in models.items():
            if (layout.ep > 1 or sizes.get("moe_grouped_gemm")) and name != "qwen3_moe" or \
                    (layout.pp > 1 and name in UNPIPELINED):
                continue
            model, run = model_with_adapter(model_dir, adapters[name], args)
            logits = pipeline_logits(model.eval(), INPUT)
            folder = os.path.join(work, layout_name, name)
            write_folder(folder, model.sharded_state_dict(),
                         SideFiles(model.config, layout, adapter_config=peft_config(run.settings, run.targets,
                                                                                    model_dir)))
            if torch.distributed.get_rank() == 0:
                export_adapter(folder, os.path.join(folder, "peft"))
            torch.distributed.barrier()
            results[(layout_name, name)] = logits
        parallel.destroy_layout()
    return results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    models = {name: save_tiny_model(name, str(root / name)) for name in ADAPTERS}
    adapters = {name: make_peft_adapter(models[name], str(root / f"{name}-adapter"), *ADAPTERS[name])
                for name in ADAPTERS}
    ranks = run_distributed(_in_layouts, 2, models, adapters, LAYOUTS, str(root / "work"))
    logits = {}
    for rank in ranks:
        logits.update({k: v for k, v in rank.items() if v is not None})
    return models, adapters, logits, str(root / "work")


CASES = [(layout, name) for layout, sizes in LAYOUTS for name in ADAPTERS
         if (name == "qwen3_moe" or not ("ep" in layout or "grouped" in layout))
         and not (layout.startswith("pp") and name in UNPIPELINED)]


@pytest.mark.parametrize("layout,name", CASES)
def test_peft_adapter_gives_peft_logits_and_exports_back(layout, name, setup):
    from peft import PeftModel

    models, adapters, logits, work = setup
    reference = peft_logits(models[name], adapters[name])
    ours = logits[(layout, name)][..., : reference.shape[-1]]
    assert (ours - reference).abs().max().item() <= 1e-4
    exported = os.path.join(work, layout, name, "peft")
    original, written = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (adapters[name], exported))
    assert sorted(written) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(written[key], tensor), key
    model = PeftModel.from_pretrained(hf_causal_lm(models[name]), exported).eval()
    with torch.no_grad():
        assert (model(INPUT).logits - reference).abs().max().item() <= 1e-5


def _count(models: dict, cases: list) -> list[int]:
    from llamafactory_mca import parallel
    from llamafactory_mca.args import MegatronArguments
    from llamafactory_mca.models.auto import AutoModel
    from llamafactory_mca.models.lora.layers import apply_lora
    from llamafactory_mca.models.lora.targets import LoraSettings

    args = MegatronArguments()
    parallel.initialize(parallel.ParallelLayout.from_args(args))
    counts = []
    for name, targets in cases:
        model = AutoModel.from_pretrained(models[name], args)
        counts.append(apply_lora(model, LoraSettings(rank=4, alpha=8, targets=tuple(targets))).trainable)
    return counts


def test_trainable_parameters_are_peft_s(tmp_path):
    """``all`` is LLaMA-Factory's expansion (on Qwen3-MoE: attention only; experts only by the word; on GLM-4.5V and
    Gemma 3 the language model's linears, not the frozen tower's; on InternVL over gpt-oss its attention projections,
    the experts being 3-D parameters; on GLM-5 not the indexer's, which transformers runs without gradient; on Gemma
    4's MoE block its router's projection too)."""
    from llamafactory.hparams import FinetuningArguments
    from llamafactory.model.model_utils.misc import find_all_linear_modules
    from llamafactory.model.model_utils.visual import patch_target_modules
    from peft import LoraConfig, get_peft_model

    cases = [("qwen3", ["all"]), ("qwen3", ["q_proj", "v_proj"]), ("qwen3_moe", ["all"]),
             ("qwen3_moe", ["all", "experts"]), ("qwen2_moe", ["q_proj", "gate_proj", "experts"]),
             ("glm4_moe", ["all"]), ("deepseek_v3", ["all", "experts"]),
             ("qwen3_next", ["all"]), ("qwen3_next", ["in_proj_qkvz", "in_proj_ba", "out_proj", "experts"]),
             ("qwen2_moe", ["all"]), ("glm4v_moe", ["all"]), ("gemma3", ["all"]), ("internvl", ["all"]),
             ("internvl_gpt_oss", ["all"]), ("minimax_m2", ["all", "experts"]), ("glm_moe_dsa", ["all"]),
             ("gemma4_text", ["all"]), ("gemma4", ["all"]), ("gemma4_text_moe", ["all", "experts"]),
             ("gemma4_text_e2b", ["all"]), ("gemma4_e2b", ["all"])]
    models = {name: save_tiny_model(name, str(tmp_path / name)) for name in {n for n, _ in cases}}
    (ours,) = run_distributed(_count, 1, models, cases)
    for (name, targets), count in zip(cases, ours):
        hf = hf_causal_lm(models[name])
        modules = [t for t in targets if t not in ("all", "experts")]
        if "all" in targets:  # less what transformers runs without gradient (GLM-5's indexer: adapters never trained)
            untrained = get_family(model_type_of(name)).no_gradient
            modules += sorted(set(find_all_linear_modules(hf, True)) - set(untrained))
        modules = patch_target_modules(hf, FinetuningArguments(finetuning_type="lora"), modules)  # a VL model's tower
        config = LoraConfig(r=4, lora_alpha=8, target_modules=modules,
                            target_parameters=EXPERT_PARAMS if "experts" in targets else None)
        peft_model = get_peft_model(hf, config)
        expected = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert count == expected, (name, targets, count, expected)
