"""``llamafactory-mca demo``: the whole path on whatever machine this is, in about a minute.

Builds a tiny Qwen3-style model and a tokenizer for the dataset shipped in ``examples/data``, trains it
with ``USE_MCA=1 llamafactory-cli train`` (two CPU processes without a GPU, all GPUs with them), merges the
last checkpoint (``llamafactory-mca merge``, in this process) and lets ``transformers`` answer a question with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from . import flags
from .merge import main as merge_main
from .tiny import save_tiny_model, save_tiny_tokenizer


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/ -> package -> checkout
DATA_DIR = os.path.join(ROOT, "examples", "data")


def _run(command: list[str], env: dict) -> None:
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, env=env, check=True)


def save_demo_model(model_dir: str) -> str:
    """The demo's tiny Qwen3-style model, with a tokenizer that knows every word of the demo's dataset."""
    with open(os.path.join(DATA_DIR, "demo_sft.json"), encoding="utf-8") as f:
        rows = json.load(f)
    save_tiny_tokenizer(model_dir, ["system user assistant"] + [r["instruction"] + " " + r["output"] for r in rows])
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    return save_tiny_model("qwen3", model_dir, vocab_size=vocab, hidden_size=128, intermediate_size=256, head_dim=32,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def demo_main(argv: list[str] | None = None) -> int:
    args = flags.demo().parse_args(argv)

    out = os.path.abspath(args.output_dir)
    hf_logging.disable_progress_bar()  # the tiny model's save and load bars say nothing here
    if not os.path.isdir(DATA_DIR):
        raise SystemExit(f"the demo dataset is missing ({DATA_DIR}); run the demo from a checkout (pip install -e .)")

    with open(os.path.join(DATA_DIR, "demo_sft.json"), encoding="utf-8") as f:
        rows = json.load(f)
    model_dir = save_demo_model(os.path.join(out, "tiny-qwen3"))

    shutil.rmtree(os.path.join(out, "saves"), ignore_errors=True)  # a fresh run each time, not a resume
    gpus = torch.cuda.device_count()
    procs = gpus or 2
    micro = 4 if procs <= 4 else 2
    accumulation = max(1, 16 // (procs * micro))  # a global batch of 16 rows on any machine: the same lesson
    recipe = {
        "model_name_or_path": model_dir, "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "demo_sft", "dataset_dir": DATA_DIR, "template": "qwen3_nothink", "cutoff_len": 64,
        "output_dir": os.path.join(out, "saves"),
        "per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation, "max_steps": args.steps,
        "learning_rate": 3.0e-3, "lr_scheduler_type": "cosine", "warmup_steps": args.steps // 10, "logging_steps": 5,
        "save_steps": args.steps, "plot_loss": True, "report_to": "none", "bf16": gpus > 0,
        "sequence_packing": True, "use_distributed_optimizer": True, "overlap_grad_reduce": True,
    }
    recipe_path = os.path.join(out, "demo_sft.yaml")
    with open(recipe_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(recipe, f, sort_keys=False)
    env = {**os.environ, "USE_MCA": "1", "NPROC_PER_NODE": str(procs)}
    _run(["llamafactory-cli", "train", recipe_path], env)

    merged = os.path.join(out, "hf")
    checkpoint = os.path.join(recipe["output_dir"], f"checkpoint-{args.steps}")
    merge_args = ["--checkpoint_path", checkpoint, "--output_path", merged]
    print("+ llamafactory-mca merge " + " ".join(merge_args), flush=True)
    if merge_main(merge_args) != 0:
        raise SystemExit(1)

    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    trained = next(r for r in rows if r["instruction"] == "What is the capital of France ?")
    question = trained["instruction"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        answer = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
    reply = tokenizer.decode(answer[0, inputs.input_ids.shape[1]:], skip_special_tokens=True).strip()
    print(f"\nQ: {question}\nA: {reply}\n(the training data says: {trained['output']})")
    print(f"\nRecipe {recipe_path}; checkpoints in {recipe['output_dir']}; Hugging Face weights in {merged}; "
          f"loss curve {os.path.join(recipe['output_dir'], 'training_loss.png')}")
    return 0
