"""The argument layer: the guide's recipe parses three ways, bad combinations fail loudly, layouts check out."""

import json
import os

import pytest
import yaml
from transformers import HfArgumentParser

from llamafactory_mca.args import MegatronArguments
from llamafactory_mca.training_args import Seq2SeqTrainingArguments, TrainingArguments


RECIPE = {
    "model_name_or_path": "Qwen/Qwen3-30B-A3B-Instruct-2507",
    "do_train": True,
    "stage": "sft",
    "finetuning_type": "full",
    "dataset": "identity,alpaca_en_demo",
    "cutoff_len": 4096,
    "template": "qwen3_nothink",
    "output_dir": "saves/mca/qwen3_moe_full_id",
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 8,
    "max_steps": 100,
    "learning_rate": 3.0e-6,
    "lr_scheduler_type": "constant",
    "bf16": True,
    "tensor_model_parallel_size": 1,
    "sequence_parallel": False,
    "pipeline_model_parallel_size": 2,
    "bias_activation_fusion": True,
    "apply_rope_fusion": True,
    "use_distributed_optimizer": True,
    "overlap_param_gather": True,
    "overlap_grad_reduce": True,
    "moe_grouped_gemm": True,
    "moe_token_dispatcher_type": "alltoall",
    "expert_model_parallel_size": 4,
    "recompute_granularity": "full",
}


def _lf_parser() -> HfArgumentParser:
    from llamafactory.hparams import DataArguments, FinetuningArguments, GeneratingArguments, ModelArguments

    return HfArgumentParser([ModelArguments, DataArguments, Seq2SeqTrainingArguments, FinetuningArguments,
                             GeneratingArguments])


def _check_recipe(training_args):
    assert isinstance(training_args, Seq2SeqTrainingArguments)
    assert training_args.pipeline_model_parallel_size == 2
    assert training_args.expert_model_parallel_size == 4
    assert training_args.use_distributed_optimizer and training_args.overlap_param_gather
    assert training_args.accumulate_allreduce_grads_in_fp32  # bf16 turns it on
    assert training_args.recompute_method == "uniform" and training_args.recompute_num_layers == 1
    assert training_args.gradient_accumulation_steps == 8 and training_args.learning_rate == 3.0e-6
    config = training_args.get_config_dict()
    assert config["moe_grouped_gemm"] is True and config["moe_token_dispatcher_type"] == "alltoall"
    assert "moe_aux_loss_coeff" not in config  # unset fields never override a checkpoint's own config


def test_recipe_parses_from_dict(tmp_path):
    *_, training_args, _, _ = _lf_parser().parse_dict({**RECIPE, "output_dir": str(tmp_path)})
    _check_recipe(training_args)


def test_recipe_parses_from_yaml(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**RECIPE, "output_dir": str(tmp_path)}))
    parsed = _lf_parser().parse_yaml_file(str(path))
    _check_recipe(parsed[2])


def test_recipe_parses_from_command_line(tmp_path):
    argv = []
    for key, value in {**RECIPE, "output_dir": str(tmp_path)}.items():
        argv += [f"--{key}", str(value)]
    parsed = _lf_parser().parse_args_into_dataclasses(args=argv)
    _check_recipe(parsed[2])


def test_recompute_modules_list_or_csv_and_additional_configs(tmp_path):
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"moe_router_topk_scaling_factor": 2.5, "hidden_dropout": 0.0}))
    args = MegatronArguments(recompute_granularity="selective", recompute_modules="core_attn, mlp",
                             additional_configs=str(extra), moe_aux_loss_coeff=0.01)
    assert args.recompute_modules == ["core_attn", "mlp"]
    config = args.get_config_dict()
    assert config["moe_router_topk_scaling_factor"] == 2.5 and config["moe_aux_loss_coeff"] == 0.01
    listed = MegatronArguments(recompute_granularity="selective", recompute_modules=["moe"],
                               additional_configs={"hidden_dropout": 0.1})
    assert listed.recompute_modules == ["moe"] and listed.get_config_dict()["hidden_dropout"] == 0.1


def test_json_round_trip(tmp_path):
    args = MegatronArguments(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=2, sequence_parallel=True,
                             use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                             moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-3, sequence_packing=True,
                             recompute_granularity="selective", recompute_modules="core_attn,moe_act")
    path = tmp_path / "mca_args.json"
    args.to_json_file(str(path))
    again = MegatronArguments.from_json_file(str(path))
    assert again == args
    assert again.get_config_dict() == args.get_config_dict()


def test_layout_string_sets_virtual_pipeline_size():
    args = MegatronArguments(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|tt|tL")
    assert args.virtual_pipeline_model_parallel_size == 2


def test_expert_and_tensor_parallel_turn_sequence_parallel_on(caplog):
    args = MegatronArguments(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert args.sequence_parallel
    assert "turning sequence_parallel on" in caplog.text


def test_variable_seq_lengths_follow_dispatcher():
    assert MegatronArguments(moe_token_dispatcher_type="alltoall").allow_variable_seq_lengths()
    assert not MegatronArguments(moe_token_dispatcher_type="allgather").allow_variable_seq_lengths()


INVALID = [
    ({"overlap_param_gather": True}, ["overlap_param_gather", "use_distributed_optimizer", "overlap_grad_reduce"]),
    ({"overlap_param_gather": True, "use_distributed_optimizer": True}, ["overlap_grad_reduce"]),
    ({"variable_seq_lengths": True, "moe_token_dispatcher_type": "allgather"},
     ["variable_seq_lengths", "allgather"]),
    ({"sequence_parallel": True}, ["sequence_parallel", "tensor_model_parallel_size"]),
    ({"recompute_method": "uniform"}, ["recompute_method", "recompute_granularity"]),
    ({"recompute_granularity": "full", "recompute_num_layers": 2}, ["recompute_num_layers", "recompute_method"]),
    ({"recompute_granularity": "full", "recompute_modules": "core_attn"}, ["recompute_modules", "full"]),
    ({"recompute_granularity": "selective", "recompute_method": "block"}, ["recompute_method", "selective"]),
    ({"recompute_granularity": "selective", "recompute_modules": "attention"}, ["recompute_modules", "attention"]),
    ({"recompute_granularity": "sometimes"}, ["recompute_granularity", "sometimes"]),
    ({"fp8_recipe": "delayed"}, ["fp8_recipe", "fp8"]),
    ({"fp8_param": True}, ["fp8_param", "fp8"]),
    ({"fp8": "e5m2"}, ["fp8", "e5m2"]),
    ({"fp8": "hybrid"}, ["fp8='hybrid' needs GPUs with FP8 tensor cores", "no NVIDIA GPU", "Drop fp8"]),  # CPU
    ({"fp8": "e4m3", "fp8_recipe": "blockwise"}, ["fp8_recipe='blockwise' needs Transformer Engine",
                                                  "tensorwise, delayed or rowwise"]),
    ({"fp8": "e4m3", "fp8_amax_history_len": 16}, ["fp8_amax_history_len=16 sets delayed scaling",
                                                    "fp8_recipe='tensorwise'", "Set fp8_recipe: delayed"]),
    ({"fp8_amax_compute_algo": "mean"}, ["fp8_amax_compute_algo='mean' is not one of most_recent, max"]),
    ({"fp8": "e4m3", "fp8_param": True}, ["fp8_param=True", "Transformer Engine", "Drop fp8_param"]),
    ({"first_last_layers_bf16": True}, ["first_last_layers_bf16=True needs fp8"]),
    ({"fp8": "e4m3", "num_layers_at_end_in_bf16": -1}, ["num_layers_at_end_in_bf16=-1 must be >= 0"]),
    ({"moe_token_dispatcher_type": "flex"}, ["moe_token_dispatcher_type", "flex"]),
    ({"moe_router_dtype": "bf16"}, ["moe_router_dtype"]),
    ({"moe_pad_expert_input_to_capacity": True}, ["moe_pad_expert_input_to_capacity", "moe_expert_capacity_factor"]),
    ({"moe_shared_expert_overlap": True, "moe_token_dispatcher_type": "allgather"},
     ["moe_shared_expert_overlap", "alltoall"]),
    ({"virtual_pipeline_model_parallel_size": 2}, ["virtual_pipeline_model_parallel_size",
                                                   "pipeline_model_parallel_size"]),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|t|tL"},
     ["pipeline_model_parallel_layout", "pipeline_model_parallel_size=2"]),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|tt|tt|tL",
      "virtual_pipeline_model_parallel_size": 3}, ["virtual_pipeline_model_parallel_size",
                                                   "pipeline_model_parallel_layout"]),
    ({"tensor_model_parallel_size": 0}, ["tensor_model_parallel_size"]),
    ({"optimizer": "adafactor"}, ["optimizer", "adafactor"]),
    ({"optimizer_cpu_offload": True}, ["optimizer_cpu_offload", "use_distributed_optimizer"]),
    ({"attention_backend": "magic"}, ["attention_backend"]),
    ({"additional_configs": "/no/such/file.json"}, ["additional_configs"]),
    ({"mtp_num_layers": -1}, ["mtp_num_layers"]),
]


@pytest.mark.parametrize("overrides,names", INVALID, ids=[",".join(o) for o, _ in INVALID])
def test_invalid_combinations_name_their_fields(overrides, names):
    with pytest.raises(ValueError) as err:
        MegatronArguments(**overrides)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_fp8_asks_the_gpus_and_reads_llamafactorys_spelling(tmp_path, monkeypatch):
    """FP8 runs where nvidia-smi names GPUs of compute capability 8.9+ (asked before any CUDA context); LLaMA-Factory's
    ``fp8: true`` is its torchao default, E4M3 rowwise; Megatron's formats default to tensorwise."""
    from llamafactory_mca.models.native.fp8 import FIELDS, Fp8Training, from_fields

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 9.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    args = MegatronArguments(fp8=True)
    assert (args.fp8, args.fp8_recipe) == ("e4m3", "rowwise")
    assert MegatronArguments(fp8="true", fp8_recipe="tensorwise").fp8_recipe == "tensorwise"
    assert MegatronArguments(fp8="false").fp8 is None
    config = MegatronArguments(fp8="hybrid", num_layers_at_start_in_bf16=2).get_config_dict()
    settings = from_fields({k: config[k] for k in FIELDS if k in config})
    assert settings == Fp8Training("hybrid", "tensorwise", True, 2, 1)
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 9.0'\necho 'NVIDIA A100-SXM4-80GB, 8.0'\n")
    with pytest.raises(ValueError, match=r"and NVIDIA A100-SXM4-80GB \(8.0\) has not\. Drop fp8"):
        MegatronArguments(fp8="e4m3")


def test_deepspeed_and_double_precision_are_refused(tmp_path):
    with pytest.raises(ValueError, match="deepspeed"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed="ds_z3.json")
    with pytest.raises(ValueError, match="bf16=True and fp16=True"):
        TrainingArguments(output_dir=str(tmp_path), bf16=True, fp16=True)


LAYOUTS = [
    ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 6, "does not divide the world size 6"),
    ({"context_parallel_size": 3}, 4, "context_parallel_size=3"),
    ({"expert_model_parallel_size": 4, "pipeline_model_parallel_size": 2}, 4, "expert_model_parallel_size=4"),
    ({"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2}, 2, "expert_tensor_parallel_size=2"),
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
      "gradient_accumulation_steps": 3}, 2, "gradient_accumulation_steps=3"),
]


@pytest.mark.parametrize("overrides,world,message", LAYOUTS)
def test_layout_checks_against_world_size(tmp_path, overrides, world, message):
    args = TrainingArguments(output_dir=str(tmp_path), **overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        args.resolve_layout(world_size=world)


def test_layout_derives_dp_and_global_batch(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                             expert_model_parallel_size=4, per_device_train_batch_size=2,
                             gradient_accumulation_steps=4)
    layout = args.resolve_layout(world_size=16, seq_length=1024)
    assert (layout.dp, layout.expert_dp) == (4, 2)
    assert layout.global_batch_size == 4 * 2 * 4
    assert layout.tokens_per_step == 32 * 1024
    assert layout.pad_multiple == 2
