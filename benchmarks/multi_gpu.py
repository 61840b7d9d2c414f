"""Two and four GPUs, through the real command: every layout's loss against one GPU's, resume across GPU counts,
faults over NCCL, and the VL and LoRA paths at TP2 / EP2. Writes ``multi_gpu.json`` and ``multi_gpu.md`` to ``--out``.

Speed and scaling are e2e_bench's (``run_gpu.sh`` phases ``two_*`` and ``node_*``); this is about fidelity and
faults, so it uses a small model that starts in seconds: Qwen3-shaped (hidden 512, 8 layers, 8 query / 4 KV heads)
and its MoE twin (8 experts, top 2), bf16, 20 steps of 16 rows (micro-batch 2) at a fine-tuning learning rate (1e-5):
at 2e-4 the tiny set's loss falls below 0.05 within ten steps, where bf16's rounding differences between layouts are
several percent of the loss and say nothing about the layouts.

Two GPUs (parts ``fidelity``, ``resume``, ``faults``, ``paths``):

- fidelity: 1 GPU against DP2, TP2 + SP, PP2, CP2 (dense) and EP2 (MoE) on the same rows: the first step's loss (the
  same weights and batch; bf16 kernels differ by layout, so within 1e-2 relative) and the largest gap over the curve
  (within 0.5%);
- resume: a DP2 checkpoint (step 10) continued on one GPU, a one-GPU checkpoint continued at TP2: steps 11-20 against
  the uninterrupted run's;
- faults: a rank stuck before step 3 (``ddp_timeout: 20``) ends the run with one line naming it; the launcher killed
  outright and one rank killed with SIGKILL leave no process behind and free both GPUs;
- VL (Qwen2-VL-shaped tiny model, images) at TP2 + SP and LoRA on the MoE model at EP2: they train.

Four GPUs (part ``node``): twice as many processes as GPUs is one line before any worker starts; a checkpoint writer
killed with SIGKILL mid-save (EP4) ends the run in one line, the previous checkpoint intact; a checkpoint written on
four GPUs resumes on two with another layout and the reverse (steps 6-10 within 1% of the writing run's); a rank
killed with SIGKILL leaves no process and frees the GPUs.

``--smoke`` runs the same on CPU processes (gloo, fp32) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llamafactory_mca.tools.tiny import (  # noqa: E402
    alpaca_rows,
    save_tiny_model,
    save_tiny_tokenizer,
    save_tiny_vl_model,
    write_alpaca_dataset,
    write_image_dataset,
)


SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64)
MOE = dict(SHAPE, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2)


def _env(gpus: int, smoke: bool, extra: dict | None = None, first: int = 0) -> dict:
    """A run on GPUs ``first .. first + gpus - 1`` (its own rendezvous port, so two runs can share a host)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMAFACTORY_MCA_FAULT",)}
    env.update(USE_MCA="1", NPROC_PER_NODE=str(gpus), PYTHONUNBUFFERED="1", MASTER_PORT=str(_free_port()))
    env["CUDA_VISIBLE_DEVICES"] = "" if smoke else ",".join(str(first + i) for i in range(gpus))
    env.update(extra or {})
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe(assets: dict, out: str, smoke: bool, **overrides) -> dict:
    base = dict(model_name_or_path=assets["dense"], stage="sft", do_train=True, finetuning_type="full",
                dataset="tiny_alpaca", dataset_dir=assets["sft"], template="qwen3_nothink", cutoff_len=128,
                output_dir=out, overwrite_output_dir=True, per_device_train_batch_size=2,
                gradient_accumulation_steps=8, max_steps=20, learning_rate=1e-5, lr_scheduler_type="constant",
                logging_steps=1, save_strategy="no", report_to="none", seed=42, disable_tqdm=True,
                preprocessing_num_workers=1, use_distributed_optimizer=True, bf16=not smoke,
                ddp_timeout=120)
    return {**base, **overrides}


def _train(work: str, name: str, config: dict, gpus: int, smoke: bool, env: dict | None = None,
           timeout: int = 240, first: int = 0) -> dict:
    import yaml

    folder = os.path.join(work, name)
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run: nothing resumed or read from an earlier invocation
    os.makedirs(folder)
    path = os.path.join(folder, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    start = time.time()
    with open(os.path.join(folder, "run.log"), "w") as log:
        try:
            result = subprocess.run(["llamafactory-cli", "train", path], env=_env(gpus, smoke, env, first), stdout=log,
                                    stderr=subprocess.STDOUT, timeout=timeout, cwd=folder)
            code = result.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    with open(os.path.join(folder, "run.log")) as f:
        output = f.read()
    return {"name": name, "rc": code, "seconds": round(time.time() - start, 1), "output": output,
            "losses": _losses(config["output_dir"])}


def _losses(out: str) -> dict[int, float]:
    found = {}
    path = os.path.join(out, "trainer_log.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                if entry.get("loss") is not None:
                    found[int(entry["current_steps"])] = float(entry["loss"])
    return found


def _last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _gap(ref: dict, got: dict, steps, absolute: bool = False) -> float | None:
    shared = [s for s in steps if s in ref and s in got]
    if not shared or len(shared) < len(list(steps)):
        return None
    return max(abs(got[s] - ref[s]) / (1.0 if absolute else abs(ref[s])) for s in shared)


def prepare(work: str) -> dict:
    assets = {"tokenizer": save_tiny_tokenizer(os.path.join(work, "tokenizer"))}
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(assets["tokenizer"])) + 5
    for key, family, shape in (("dense", "qwen3", SHAPE), ("moe", "qwen3_moe", MOE)):
        path = os.path.join(work, key)
        if not os.path.isdir(path):
            save_tiny_model(family, path, vocab_size=vocab, **shape)
            save_tiny_tokenizer(path)
        assets[key] = path
    assets["sft"] = write_alpaca_dataset(os.path.join(work, "sft"), 0, rows=alpaca_rows(400))
    assets["vl"] = os.path.join(work, "vl")
    if not os.path.isdir(assets["vl"]):
        save_tiny_vl_model("qwen2_vl", assets["vl"])
    assets["images"] = write_image_dataset(os.path.join(work, "images"), 32)
    return assets


LAYOUTS = {"1gpu": (1, {}), "dp2": (2, {"gradient_accumulation_steps": 4}),
           "tp2_sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
           "pp2": (2, {"pipeline_model_parallel_size": 2}), "cp2": (2, {"context_parallel_size": 2})}


def fidelity(assets: dict, work: str, smoke: bool) -> list[dict]:
    runs = {}
    for name, (gpus, layout) in LAYOUTS.items():
        runs[name] = _train(work, name, _recipe(assets, os.path.join(work, name, "out"), smoke, **layout), gpus, smoke)
    moe = {"model_name_or_path": assets["moe"]}
    runs["moe_1gpu"] = _train(work, "moe_1gpu", _recipe(assets, os.path.join(work, "moe_1gpu", "out"), smoke, **moe),
                              1, smoke)
    runs["moe_ep2"] = _train(work, "moe_ep2", _recipe(assets, os.path.join(work, "moe_ep2", "out"), smoke, **moe,
                                                      expert_model_parallel_size=2, gradient_accumulation_steps=4),
                             2, smoke)
    rows = []
    for name, ref in (("dp2", "1gpu"), ("tp2_sp", "1gpu"), ("pp2", "1gpu"), ("cp2", "1gpu"), ("moe_ep2", "moe_1gpu")):
        a, b = runs[ref], runs[name]
        first = _gap(a["losses"], b["losses"], [1])
        curve = _gap(a["losses"], b["losses"], range(1, 21))
        rows.append({"check": f"{name} vs {ref}", "rc": b["rc"], "first_step_loss": b["losses"].get(1),
                     "reference_first_step_loss": a["losses"].get(1), "first_step_rel_gap": first,
                     "max_rel_gap_20_steps": curve, "max_abs_gap_20_steps": _gap(a["losses"], b["losses"],
                                                                                  range(1, 21), absolute=True),
                     "last_loss": b["losses"].get(20), "reference_last_loss": a["losses"].get(20),
                     "ok": b["rc"] == 0 and a["rc"] == 0 and first is not None and first <= 1e-2
                     and curve is not None and curve <= 5e-3, "seconds": b["seconds"]})
    return rows


def resume(assets: dict, work: str, smoke: bool) -> list[dict]:
    """A DP2 checkpoint (step 10) continued on one GPU, a one-GPU checkpoint continued at TP2 + SP: steps 11-20
    against the uninterrupted runs."""
    save = {"save_strategy": "steps", "save_steps": 10}
    runs = {name: _train(work, f"resume_src_{name}", _recipe(assets, os.path.join(work, f"resume_src_{name}", "out"),
                                                             smoke, **LAYOUTS[name][1], **save), LAYOUTS[name][0],
                         smoke) for name in ("1gpu", "dp2")}
    rows = []
    for name, source, gpus, layout in (("dp2 -> 1 GPU", "dp2", 1, {}),
                                       ("1 GPU -> TP2 + SP", "1gpu", 2, LAYOUTS["tp2_sp"][1])):
        checkpoint = os.path.join(work, f"resume_src_{source}", "out", "checkpoint-10")
        folder = f"resumed_from_{source}"
        run = _train(work, folder, _recipe(assets, os.path.join(work, folder, "out"), smoke, **layout,
                                           resume_from_checkpoint=checkpoint), gpus, smoke)
        gap = _gap(runs[source]["losses"], run["losses"], range(11, 21))
        rows.append({"check": f"resume {name}", "rc": run["rc"], "max_rel_gap_steps_11_20": gap,
                     "seconds": run["seconds"], "ok": run["rc"] == 0 and gap is not None and gap <= 5e-3,
                     "resume_line": next((line.split(">> ", 1)[-1].replace(work + os.sep, "")
                                          for line in run["output"].splitlines() if "Resuming" in line), None)})
    return rows


def _processes_of(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _gpu_apps() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.splitlines() if line.strip()]


def _kill_test(assets: dict, work: str, smoke: bool, name: str, victim: str, gpus: int = 2) -> dict:
    """Start a long run on ``gpus`` GPUs, kill ``victim`` (the launcher, or one rank) with SIGKILL after the first
    save, and check that no process of the run is left and the GPUs hold nothing."""
    import psutil
    import yaml

    folder = os.path.join(work, name)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    out = os.path.join(folder, "out")
    path = os.path.join(folder, "recipe.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(_recipe(assets, out, smoke, max_steps=100000, save_strategy="steps", save_steps=3,
                               save_total_limit=1), f)
    log = open(os.path.join(folder, "run.log"), "w")
    proc = subprocess.Popen(["llamafactory-cli", "train", path], env=_env(gpus, smoke), stdout=log,
                            stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and not (os.path.isdir(out) and any(n.startswith("checkpoint-") for n in
                                                                   os.listdir(out))):
        time.sleep(0.5)
    everything = _processes_of(proc.pid)
    ranks = everything[0].children() if everything else []  # the launcher's: the workers, not what they forked
    target = proc.pid if victim == "launcher" else (ranks[-1].pid if ranks else proc.pid)
    os.kill(target, signal.SIGKILL)
    start = time.time()
    gone = False
    while time.time() - start < 90:
        alive = [p for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            gone = True
            break
        time.sleep(0.5)
    seconds = round(time.time() - start, 1)
    left = [p.pid for p in everything if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in everything:
        if p.is_running():
            p.kill()
    proc.wait(timeout=30)
    log.close()
    apps = [] if smoke else _gpu_apps()
    with open(os.path.join(folder, "run.log")) as f:
        last = _last_line(f.read())
    return {"check": name, "killed": victim, "processes": len(everything), "all_gone": gone,
            "seconds_until_gone": seconds, "left": left, "gpu_apps_after": apps, "last_line": last,
            "ok": gone and not apps}


def faults(assets: dict, work: str, smoke: bool) -> list[dict]:
    rows = []
    run = _train(work, "hang", _recipe(assets, os.path.join(work, "hang", "out"), smoke, max_steps=8, ddp_timeout=20),
                 2, smoke, env={"LLAMAFACTORY_MCA_FAULT": "hang:3@1"}, timeout=300)
    last = _last_line(run["output"])
    rows.append({"check": "a rank stuck before step 3, ddp_timeout 20", "rc": run["rc"], "seconds": run["seconds"],
                 "last_line": last, "ok": run["rc"] not in (0, "timeout") and "rank 1" in last
                 and "ddp_timeout=20" in last and "Traceback" not in run["output"]})
    rows.append(_kill_test(assets, work, smoke, "kill_launcher", "launcher"))
    rows.append(_kill_test(assets, work, smoke, "kill_rank", "rank"))
    return rows


def node(assets: dict, work: str, smoke: bool) -> list[dict]:
    """Four GPUs: more processes than GPUs; a checkpoint writer killed mid-save at EP4; that run's previous checkpoint
    resumed on two GPUs at PP2, and a two-GPU PP2 checkpoint resumed on four at PP2 x EP2 (the same global batch of
    16 rows: steps 6-10 against the run that wrote the checkpoint); a rank killed with SIGKILL at four GPUs."""
    rows = [] if smoke else [_too_many_processes(assets, work)]
    moe, pp2 = {"model_name_or_path": assets["moe"]}, {"pipeline_model_parallel_size": 2}
    saves = {"save_strategy": "steps", "save_steps": 5, "max_steps": 10}
    ep4 = {"expert_model_parallel_size": 4, "gradient_accumulation_steps": 2}
    killed = _train(work, "writer_killed", _recipe(assets, os.path.join(work, "writer_killed", "out"), smoke, **moe,
                                                   **saves, **ep4), 4, smoke,
                    env={"LLAMAFACTORY_MCA_FAULT": "writer:10@2"})
    rows.append(_writer_row(killed, os.path.join(work, "writer_killed", "out"), smoke))
    with ThreadPoolExecutor(2) as pool:  # GPUs 0-1 and 2-3
        down = pool.submit(_train, work, "resumed_4_to_2", _recipe(
            assets, os.path.join(work, "resumed_4_to_2", "out"), smoke, **moe, **pp2, max_steps=10,
            resume_from_checkpoint=os.path.join(work, "writer_killed", "out", "checkpoint-5")), 2, smoke)
        source = pool.submit(_train, work, "source_2", _recipe(assets, os.path.join(work, "source_2", "out"), smoke,
                                                               **moe, **pp2, **saves), 2, smoke, first=2)
        down, source = down.result(), source.result()
    up = _train(work, "resumed_2_to_4", _recipe(
        assets, os.path.join(work, "resumed_2_to_4", "out"), smoke, **moe, **pp2, expert_model_parallel_size=2,
        gradient_accumulation_steps=4, max_steps=10,
        resume_from_checkpoint=os.path.join(work, "source_2", "out", "checkpoint-5")), 4, smoke)
    for name, run, ref in (("EP4 on 4 -> PP2 on 2", down, killed), ("PP2 on 2 -> PP2 x EP2 on 4", up, source)):
        gap = _gap(ref["losses"], run["losses"], range(6, 11))
        rows.append({"check": f"resume {name}", "rc": run["rc"], "max_rel_gap_steps_6_10": gap,
                     "seconds": run["seconds"], "ok": run["rc"] == 0 and gap is not None and gap <= 1e-2})
    rows.append(_kill_test(assets, work, smoke, "kill_rank_4", "rank", gpus=4))
    return rows


def _too_many_processes(assets: dict, work: str) -> dict:
    import torch

    gpus = torch.cuda.device_count()
    visible = ",".join(map(str, range(gpus)))
    run = _train(work, "too_many", _recipe(assets, os.path.join(work, "too_many", "out"), False), 2 * gpus, False,
                 env={"CUDA_VISIBLE_DEVICES": visible})
    last = _last_line(run["output"])
    return {"check": f"NPROC_PER_NODE={2 * gpus} on {gpus} GPUs", "rc": run["rc"], "seconds": run["seconds"],
            "last_line": last, "ok": run["rc"] not in (0, "timeout") and "Traceback" not in run["output"]
            and last.startswith("[llamafactory_mca] error: NPROC_PER_NODE=") and f"Set NPROC_PER_NODE={gpus}" in last}


def _writer_row(run: dict, out: str, smoke: bool) -> dict:
    from llamafactory_mca.checkpoints import verify_checkpoint
    from llamafactory_mca.errors import UserError

    last = _last_line(run["output"])
    try:
        verify_checkpoint(os.path.join(out, "checkpoint-5"))
        intact = True
    except UserError:
        intact = False
    left = sorted(n for n in os.listdir(out) if n.startswith(("tmp-", "checkpoint-10"))) if os.path.isdir(out) else []
    apps = [] if smoke else _gpu_apps()
    return {"check": "a checkpoint writer of rank 2 killed with SIGKILL while writing checkpoint-10 (EP4)",
            "rc": run["rc"], "seconds": run["seconds"], "last_line": last, "checkpoint_5_intact": intact,
            "left_behind": left, "gpu_apps_after": apps,
            "ok": run["rc"] not in (0, "timeout") and "Traceback" not in run["output"] and intact and not left
            and not apps and "saving checkpoint-10 failed: rank 2's checkpoint writer" in last}


def paths(assets: dict, work: str, smoke: bool) -> list[dict]:
    rows = []
    vl = dict(model_name_or_path=assets["vl"], dataset="tiny_images", dataset_dir=assets["images"],
              template="qwen2_vl", cutoff_len=256, image_max_pixels=768, image_min_pixels=256, max_steps=6,
              learning_rate=1e-4, gradient_accumulation_steps=4, tensor_model_parallel_size=2, sequence_parallel=True)
    lora = dict(model_name_or_path=assets["moe"], finetuning_type="lora", lora_rank=8, lora_target="all",
                learning_rate=1e-3, max_steps=6, expert_model_parallel_size=2, gradient_accumulation_steps=4)
    for name, config in (("vl_tp2_sp", vl), ("lora_moe_ep2", lora)):
        run = _train(work, name, _recipe(assets, os.path.join(work, name, "out"), smoke, **config), 2, smoke)
        got = run["losses"]
        rows.append({"check": name, "rc": run["rc"], "seconds": run["seconds"], "first_loss": got.get(1),
                     "last_loss": got.get(6), "ok": run["rc"] == 0 and len(got) == 6 and got[6] < got[1]})
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Several GPUs: fidelity, resume, faults ({result['machine']})", ""]
    for section in ("fidelity", "resume", "faults", "paths", "node"):
        rows = result.get(section, [])
        if not rows:
            continue
        keys = [k for k in rows[0] if k not in ("output",)]
        for row in rows[1:]:
            keys += [k for k in row if k not in keys and k != "output"]
        lines += [f"## {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for row in rows:
            lines.append("| " + " | ".join(_cell(row.get(k)) for k in keys) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.5g}"
    return str(value).replace("|", "/") if value is not None else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/multi_gpu")
    parser.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "multi_gpu"))
    parser.add_argument("--parts", default="fidelity,resume,faults,paths")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    import torch

    machine = "CPU (gloo, fp32)" if args.smoke else f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    result = {"machine": machine, "torch": torch.__version__}
    path = os.path.join(args.out, "multi_gpu.json")
    if os.path.isfile(path):
        with open(path) as f:
            result.update({k: v for k, v in json.load(f).items() if k not in ("machine", "torch")})
    assets = prepare(args.work)
    for part in args.parts.split(","):
        parts = {"fidelity": fidelity, "resume": resume, "faults": faults, "paths": paths, "node": node}
        result[part] = parts[part](assets, args.work, args.smoke)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "multi_gpu.md"), "w") as f:
            f.write(markdown(result))
        for row in result[part]:
            print(("ok  " if row.get("ok") else "FAIL"), json.dumps({k: v for k, v in row.items() if k != "output"}),
                  flush=True)


if __name__ == "__main__":
    main()
