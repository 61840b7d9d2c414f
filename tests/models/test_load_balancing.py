"""The router's load balancing a run trains with: as LLaMA-Factory's default path by default (no load-balancing loss
unless moe_aux_loss_coef sets its weight, a sigmoid router's expert bias never updated), Megatron's practice with
``moe_balancing: checkpoint`` (the checkpoint's router_aux_loss_coef, the bias updated); the summary says which and
the key that changes it."""

import pytest

from llamafactory_mca.args import MegatronArguments
from llamafactory_mca.errors import UserError
from llamafactory_mca.models.auto import build_transformer_config, describe_load_balancing, resolve_load_balancing
from llamafactory_mca.models.families import get_family
from llamafactory_mca.tools.tiny import tiny_hf_config


def planned(name: str, coef: float | None, checkpoint: float = 0.001, **recipe):
    hf = tiny_hf_config(name, router_aux_loss_coef=checkpoint)
    config = get_family(hf.model_type).config_from_hf(hf)
    args = MegatronArguments(**recipe)
    config, source = resolve_load_balancing(config, args, coef)
    tc = build_transformer_config(config, args)
    return tc, describe_load_balancing(tc, config.hf_model_type, source)


def test_by_default_no_load_balancing_loss_trains_as_in_llamafactorys_default_path():
    tc, said = planned("qwen3_moe", None)
    assert (tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff) == ("aux_loss", 0.0)
    assert said == ("no load-balancing loss, as in LLaMA-Factory's default path (moe_aux_loss_coef sets a weight; "
                    "moe_balancing: checkpoint trains the checkpoint's router_aux_loss_coef)")


def test_moe_balancing_checkpoint_trains_the_checkpoints_coefficient_and_names_it():
    tc, said = planned("qwen3_moe", None, moe_balancing="checkpoint")
    assert (tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff) == ("aux_loss", 0.001)
    assert said == ("load-balancing loss aux_loss x 0.001 (the checkpoint's router_aux_loss_coef), logged apart as "
                    "load_balancing_loss: loss is the language-model loss; LLaMA-Factory's default path trains "
                    "qwen3_moe without it (moe_balancing: llamafactory)")
    with pytest.raises(UserError, match="moe_balancing='megatron'"):
        MegatronArguments(moe_balancing="megatron")


@pytest.mark.parametrize("coef,weight,words", [
    (0.0, 0.0, "no load-balancing loss (moe_aux_loss_coef: 0), as in LLaMA-Factory's default path"),
    (0.02, 0.02, "load-balancing loss aux_loss x 0.02 (moe_aux_loss_coef), logged apart as load_balancing_loss"),
])
def test_llamafactorys_key_decides_the_coefficient(coef, weight, words):
    tc, said = planned("qwen3_moe", coef)
    assert tc.moe_aux_loss_coeff == weight and said.startswith(words) and "default path trains" not in said
    assert planned("qwen3_moe", coef, moe_aux_loss_coeff=coef)[0].moe_aux_loss_coeff == weight  # both keys agree
    with pytest.raises(UserError, match=r"moe_aux_loss_coef=.* and moe_aux_loss_coeff=0.5 .Megatron's. disagree"):
        planned("qwen3_moe", coef, moe_aux_loss_coeff=0.5)


def test_families_llamafactory_ignores_the_key_for_are_named():
    tc, said = planned("qwen3_vl_moe", 0.01)
    assert tc.moe_aux_loss_coeff == 0.01
    assert said.endswith("LLaMA-Factory's default path ignores moe_aux_loss_coef for qwen3_vl_moe")


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_sigmoid_routing_keeps_its_loaded_bias_unless_asked(family):
    tc, said = planned(family, None)
    assert (tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff, tc.moe_router_enable_expert_bias,
            tc.moe_router_bias_update_rate) == ("none", 0.0, True, 0.0)
    assert said.startswith("routing with the checkpoint's expert bias, held as loaded (LLaMA-Factory's default path; "
                           "moe_balancing: checkpoint updates it); no load-balancing loss, as in LLaMA-Factory's")
    tc, said = planned(family, None, moe_balancing="checkpoint")  # Megatron's aux-loss-free balancing
    assert (tc.moe_aux_loss_coeff, tc.moe_router_bias_update_rate) == (0.0, 1e-3)
    assert said == ("routing balanced by the expert bias, updated each step (aux-loss-free); no load-balancing loss, "
                    "as in LLaMA-Factory's default path")
    tc, said = planned(family, 1e-4)  # DeepSeek-V3's sequence-wise loss beside the bias
    assert (tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff, tc.moe_router_enable_expert_bias) == \
        ("seq_aux_loss", 1e-4, True)
    assert "seq_aux_loss x 0.0001 (moe_aux_loss_coef), logged apart as seq_load_balancing_loss" in said
    tc, _ = planned(family, 1e-4, moe_router_load_balancing_type="aux_loss")  # the recipe's type wins
    assert (tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff) == ("aux_loss", 1e-4)


def test_dense_models_have_no_load_balancing():
    hf = tiny_hf_config("qwen3")
    config = get_family(hf.model_type).config_from_hf(hf)
    assert resolve_load_balancing(config, MegatronArguments(), 0.01) == (config, "")


@pytest.mark.parametrize("name, graphs, frozen_base, on", [
    ("qwen3", False, False, True),  # eager dense, full: its weight gradients into main_grad, fewer launches
    ("qwen3", True, False, True),  # graphed layers
    ("qwen3", False, True, False),  # LoRA: a frozen base computes no weight gradients
    ("qwen3_moe", False, False, True),  # MoE: the step waits on the GPU
    ("qwen3_moe", False, True, False),  # LoRA on MoE: a frozen base, the step waits on the host again
])
def test_fusion_defaults_follow_where_the_step_waits(name, graphs, frozen_base, on, monkeypatch):
    """The three fusions' defaults on a GPU (the CPU keeps them off): on unless only adapters train eagerly."""
    from types import SimpleNamespace

    from llamafactory_mca.models import auto

    monkeypatch.setattr(auto, "cpu_mode_needed", lambda: False)
    hf = tiny_hf_config(name)
    config = get_family(hf.model_type).config_from_hf(hf)
    fields = auto._engine_fields(config, SimpleNamespace(bf16=True, run_cuda_graphs=lambda: graphs), frozen_base)
    assert [fields[k] for k in ("gradient_accumulation_fusion", "apply_rope_fusion", "qk_norm_fusion")] == [on] * 3


@pytest.mark.parametrize("pp, vpp, batched", [(2, 2, False), (2, None, True), (4, 2, True), (1, None, True)])
def test_pipeline_sends_are_batched_only_where_each_pairs_unambiguously(pp, vpp, batched, monkeypatch):
    """At PP2 with the interleaved schedule both neighbours are one rank: batched, an activation and a gradient to it
    were paired with the wrong receives (a PP2 x VPP2 x DP2 run on four GPUs trained on swapped tensors)."""
    from types import SimpleNamespace

    from llamafactory_mca.models import auto

    monkeypatch.setattr(auto, "cpu_mode_needed", lambda: False)
    hf = tiny_hf_config("qwen3")
    config = get_family(hf.model_type).config_from_hf(hf)
    args = SimpleNamespace(bf16=True, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    assert auto._engine_fields(config, args)["batch_p2p_comm"] is batched
    monkeypatch.setattr(auto, "cpu_mode_needed", lambda: True)
    assert auto._engine_fields(config, args)["batch_p2p_comm"] is False
