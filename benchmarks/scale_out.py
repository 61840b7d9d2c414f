"""The scale-out layouts at 4 and 8 processes, each checked against a smaller layout.

    python benchmarks/scale_out.py --out benchmarks/results/scale_out_cpu      # CPU (gloo), tiny models
    python benchmarks/scale_out.py --runs long_cp4 --out ...                  # one layout; the others' results stay

It launches ``llamafactory-cli`` as the training tests do, so run it with the environment's ``bin`` on PATH.

For every layout: the first steps' losses equal a smaller layout's on the same data, a checkpoint resumes onto
a different data-parallel size with the uninterrupted run's losses, and ``scripts/megatron_merge.py`` gives a
model that ``transformers`` loads. On CPU the models are tiny Qwen3 / Qwen3-MoE stand-ins with the same
structure (GQA, qk-norm, 8 experts top-2); no 4- or 8-GPU machine was available to us, so real shapes,
tokens/s and memory are still to be measured on one with the same script (``--gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PACKED_256 = {"cutoff_len": 256, "sequence_packing": True, "per_device_train_batch_size": 1,
              "gradient_accumulation_steps": 2}
OVERLAP = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}
# name: (model, world, layout keys, reference world, reference keys); global batch = dp x micro x accum stays 8
RUNS = {
    "dense_tp2_pp2_vpp2_sp": ("qwen3", 4, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                            "virtual_pipeline_model_parallel_size": 2, "sequence_parallel": True,
                                            "gradient_accumulation_steps": 8, **OVERLAP}, 1, {}),
    "moe_ep4_alltoall_grouped": ("qwen3_moe", 4, {"expert_model_parallel_size": 4, "moe_grouped_gemm": True,
                                                  "moe_token_dispatcher_type": "alltoall",
                                                  "gradient_accumulation_steps": 2}, 1, {}),
    # packed 256-token micro-batches: the tiny dataset makes 6 of them, so 2 per step (global batch 2)
    "long_cp4": ("qwen3", 4, {"context_parallel_size": 4, **PACKED_256}, 1, PACKED_256),
    "guide_moe_layout_4": ("qwen3_moe", 4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                            "recompute_granularity": "full", "moe_grouped_gemm": True,
                                            "gradient_accumulation_steps": 4, **OVERLAP}, 1, {}),
    "guide_moe_layout_8": ("qwen3_moe", 8, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 4,
                                            "recompute_granularity": "full", "moe_grouped_gemm": True,
                                            "gradient_accumulation_steps": 2, **OVERLAP}, 1, {}),
}


def run_one(name: str, work: str, assets: dict, gpu: bool) -> dict:
    from tests._cli import losses, recipe, train

    model, world, keys, ref_world, ref_keys = RUNS[name]
    base = dict(model_name_or_path=assets["models"][model], max_steps=4, save_steps=2, save_strategy="steps",
                bf16=gpu, gradient_accumulation_steps=8)
    result: dict = {"world": world, "layout": keys}
    ref_config = recipe(assets, os.path.join(work, "ref"), **{**base, **ref_keys})
    done, _ = train(work, ref_config, ref_world, name="ref", gpu=gpu, timeout=1800)
    if done.returncode:
        return {**result, "status": f"reference failed, see {work}/ref.log"}
    reference = losses(os.path.join(work, "ref"))
    out = os.path.join(work, "run")
    config = recipe(assets, out, **{**base, **keys})
    start = time.time()
    train(work, config, world, {"LLAMAFACTORY_MCA_FAULT": "step:3"}, name="crash", gpu=gpu, timeout=1800)
    result["seconds_to_crash"] = round(time.time() - start, 1)
    # resume onto another data-parallel size: twice the processes with the same model-parallel sizes, where the host
    # has them (8 CPU processes; GPUs: as many as are visible), else the same size
    resume_world = world * 2 if world * 2 <= _slots(gpu) else world
    accum = keys.get("gradient_accumulation_steps", 8) * world // resume_world
    config = {**config, "overwrite_output_dir": False, "gradient_accumulation_steps": accum}
    done, _ = train(work, config, resume_world, name="resume", gpu=gpu, timeout=1800)
    if done.returncode:
        return {**result, "status": f"resume failed, see {work}/resume.log"}
    got = losses(out)
    result.update(reference=reference, losses=got, resume_world=resume_world)
    result["first_steps_match"] = all(abs(got[s] - reference[s]) <= 1e-3 * abs(reference[s]) for s in (1, 2))
    result["resumed_losses_match"] = all(abs(got[s] - reference[s]) <= 1e-3 * abs(reference[s]) for s in (3, 4))
    merged = os.path.join(work, "merged")
    merge = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "megatron_merge.py"), "--checkpoint_path",
                            os.path.join(out, "checkpoint-4"), "--output_path", merged],
                           capture_output=True, text=True)
    loads = False
    if merge.returncode == 0:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(merged)
        loads = True
    result["merged_model_loads"] = loads
    result["status"] = "ok" if (result["first_steps_match"] and result["resumed_losses_match"] and loads) \
        else "mismatch"
    return result


def _slots(gpu: bool) -> int:
    """Processes the host can run: its visible GPUs, or 8 CPU processes."""
    if not gpu:
        return 8
    import torch

    return torch.cuda.device_count()


def make_assets(root: str) -> dict:
    from transformers import AutoTokenizer

    from llamafactory_mca.tools.tiny import alpaca_rows, save_tiny_model, save_tiny_tokenizer, write_alpaca_dataset

    tokenizer = save_tiny_tokenizer(os.path.join(root, "tokenizer"))
    vocab = len(AutoTokenizer.from_pretrained(tokenizer)) + 5
    models = {}
    for name, extra in (("qwen3", {}), ("qwen3_moe", {"num_experts": 8})):
        models[name] = save_tiny_model(name, os.path.join(root, name), vocab_size=vocab, **extra)
        save_tiny_tokenizer(models[name])
    return {"models": models, "sft": write_alpaca_dataset(os.path.join(root, "sft"), 64, rows=alpaca_rows(64))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--work", default=os.path.join(ROOT, "benchmarks", "runs", "scale_out"))
    parser.add_argument("--gpu", action="store_true", help="run on GPUs (bf16) instead of CPU processes")
    args = parser.parse_args()
    assets = make_assets(os.path.join(args.work, "assets"))
    results: dict = {}
    path = os.path.join(args.out, "scale_out.json")
    if os.path.isfile(path):  # keep the runs this invocation does not redo
        with open(path) as f:
            results = json.load(f)
    for name in args.runs.split(","):
        if RUNS[name][1] > _slots(args.gpu):
            results[name] = {"world": RUNS[name][1], "layout": RUNS[name][2],
                             "status": f"skipped: needs {RUNS[name][1]} processes, the host has {_slots(args.gpu)}"}
            print(name, results[name]["status"])
            continue
        work = os.path.join(args.work, name)
        os.makedirs(work, exist_ok=True)
        results[name] = run_one(name, work, assets, args.gpu)
        print(name, json.dumps({k: v for k, v in results[name].items() if k in ("status", "losses", "reference")}))
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    rows = ["| run | processes | layout | first 2 steps = reference | resumed onto dp' = uninterrupted | merge loads |"
            " status |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rows.append(f"| {name} | {r['world']} | {r['layout']} | {r.get('first_steps_match')} | "
                    f"{r.get('resumed_losses_match')} (resume on {r.get('resume_world')}) | "
                    f"{r.get('merged_model_loads')} | {r['status']} |")
    with open(os.path.join(args.out, "scale_out.md"), "w") as f:
        f.write(("GPU" if args.gpu else "CPU (gloo, tiny models)") + " scale-out runs\n\n" + "\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
