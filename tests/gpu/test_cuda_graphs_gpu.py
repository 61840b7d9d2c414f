"""``cuda_graphs: true`` on one CUDA GPU through the real command: every layer captured in the first step and replayed
after trains what eager layers train (dense and MoE, full and LoRA, bf16, packed), evaluation runs beside the graphs,
and a checkpoint written by a graphed run resumes.

Run: ``python -m pytest tests/gpu/test_cuda_graphs_gpu.py -q`` (skipped without CUDA).
"""

import pytest
import torch

from tests._cli import losses, ok, recipe, train


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("model, fused, lora, merge, fp8", [
    ("qwen3", True, None, 1, None), ("qwen3_moe", True, None, 1, None), ("qwen3_moe", True, None, 2, None),
    ("qwen3", True, "all", 1, None), ("qwen3_moe", True, "all,experts", 1, None), ("qwen3", True, None, 1, "delayed"),
    ("qwen3", True, "all", 1, "tensorwise")])
def test_graphed_layers_train_what_eager_layers_train(model, fused, lora, merge, fp8, assets, tmp_path):
    """``fused``: both runs GEMM weight gradients into main_grad and run the Triton RoPE and q/k norms (the graphed
    default); without it both run without them, so that the first, eager, step of each is the same computation.
    ``lora``: the base frozen, the adapters (on the grouped experts too) inside the graphed layers, gathered after
    each step overlapped with the next forward (a replay waits for them in megatron-core's DDP hooks). ``merge``: both
    runs' micro-batches merged as given (graphs capture the merged packs). ``fp8``: both runs' middle layers in FP8
    under that recipe (a replay casts its trained weights; a frozen base's casts, made once, serve every replay)."""
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    curves = {}
    tuning = dict(finetuning_type="lora", lora_target=lora, learning_rate=1e-3, use_distributed_optimizer=True,
                  overlap_grad_reduce=True, overlap_param_gather=True) if lora else dict(learning_rate=1e-4)
    tuning["merge_micro_batches"] = merge  # both runs the same computation: auto would merge the eager one alone
    if fp8:
        tuning.update(fp8="hybrid", fp8_recipe=fp8)
    for graphs in (False, True):
        name = f"{model}_graphs_{graphs}"
        config = recipe(assets, tmp_path / name, model_name_or_path=assets["models"][model], bf16=True,
                        moe_grouped_gemm=model == "qwen3_moe", sequence_packing=True, cuda_graphs=graphs,
                        gradient_accumulation_fusion=fused, apply_rope_fusion=fused, qk_norm_fusion=fused,
                        max_steps=6, **tuning,
                        eval_dataset="tiny_alpaca",
                        eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=2, save_strategy="steps",
                        save_steps=3)
        result, output = train(tmp_path, config, gpu=True, name=name)
        ok(result, output)
        assert ("every layer a CUDA graph" in output) == graphs, output[-3000:]
        assert (f"FP8 {fp8}" in output) == bool(fp8), output[-3000:]
        assert output.count("eval loss") == 2, output[-3000:]
        curves[graphs] = losses(tmp_path / name)
    assert curves[True].keys() == curves[False].keys() == set(range(1, 7))
    # the first step runs eagerly (and records the graphs); the compiled kernels may differ in reduction order where
    # the eager run's packs vary in length (a dynamic-shape compile) and the graphed run's do not
    assert curves[True][1] == pytest.approx(curves[False][1], rel=1e-6 if fused else 0)
    for step, loss in curves[False].items():  # bf16: replayed GEMMs may sum in another order
        assert curves[True][step] == pytest.approx(loss, rel=2e-3), (step, curves)
    # a graphed run's checkpoint continues, under graphs again, where the uninterrupted run went
    graphed = tmp_path / f"{model}_graphs_True"
    config = recipe(assets, tmp_path / "resumed", model_name_or_path=assets["models"][model], bf16=True,
                    moe_grouped_gemm=model == "qwen3_moe", sequence_packing=True, cuda_graphs=True,
                    gradient_accumulation_fusion=fused, apply_rope_fusion=fused, qk_norm_fusion=fused, max_steps=6,
                    resume_from_checkpoint=str(graphed / "checkpoint-3"), **tuning)
    result, output = train(tmp_path, config, gpu=True, name="resumed")
    ok(result, output)
    resumed = losses(tmp_path / "resumed")
    assert resumed[6] == pytest.approx(curves[True][6], rel=2e-3), (resumed, curves[True])
