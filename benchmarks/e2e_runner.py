"""Runs one workload: writes each run's recipe, launches it as LLaMA-Factory's launcher would, and reads back the
numbers ``_e2e_entry.py`` recorded in every rank.

Each run is its own process group under a timeout, so a hung or crashed run costs its own row, not the invocation.
torch and llamafactory_mca are imported where they are used (about 1.5 s), so ``--help`` and ``--merge`` start at
once; the parent only reads versions and counts FLOPs with them, and leaves the GPUs to the runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
import yaml
from e2e_workloads import (
    LABELS,
    MOE_KINDS,
    VL,
    VL_TEMPLATE,
    Run,
    Workload,
    digest,
    model_config,
    prepare_dataset,
    prepare_model,
)


ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_e2e_entry.py")
LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_e2e_launch.py")


# ---- machine and versions -----------------------------------------------------------------------------------------
def machine_info(smoke: bool) -> dict:
    probe = ("import json, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; "
             "print(json.dumps({'count': n, 'names': [torch.cuda.get_device_name(i) for i in range(n)], "
             "'memory_gib': [round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1) for i in range(n)]}))")
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if smoke else {})}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    gpus = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"count": 0, "names": []}
    if not gpus["count"]:
        gpus.update(names=[], device=f"CPU ({os.cpu_count()} cores, gloo)")
    else:
        gpus["device"] = f"{gpus['count']} x {gpus['names'][0]}"
    return gpus


def versions() -> dict:
    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "megatron-core", "llamafactory", "llamafactory-mca", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def peak_flops_for(name: str) -> float | None:
    from llamafactory_mca.models.cost import PEAK_BF16_FLOPS

    for key, value in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return value
    return None


# ---- one run ------------------------------------------------------------------------------------------------------
def recipe(w: Workload, run: Run, model_dir: str, data_dir: str, out_dir: str, steps: int, args) -> dict:
    """The run's settings; one step more than ``steps``, the one profiled (see ``launch``)."""
    r = dict(model_name_or_path=model_dir, stage="sft", do_train=True, finetuning_type="full", dataset="e2e",
             dataset_dir=data_dir, cutoff_len=w.cutoff,
             template=VL_TEMPLATE[VL[w.model]["model_type"]] if w.model in VL else "qwen3_nothink",
             output_dir=out_dir,
             overwrite_output_dir=True, per_device_train_batch_size=run.micro_batch,
             gradient_accumulation_steps=run.grad_accum, max_steps=steps + 1, learning_rate=args.lr,
             lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
             save_strategy="no", report_to="none", seed=42, disable_tqdm=True, plot_loss=False,
             preprocessing_num_workers=1 if args.smoke else 4)
    r.update({"use_cpu": True} if args.smoke else {"bf16": True})
    r.update(w.tuning)
    if run.path == "lf":
        r["flash_attn"] = "sdpa"
        if run.packing:
            r["neat_packing"] = True
        # no moe_aux_loss_coef: LLaMA-Factory's default trains MoE without the load-balancing loss (and with it,
        # neat_packing's 4-D mask breaks transformers' load_balancing_loss_func); ours keeps the config's 0.001
    else:
        r.update(sequence_packing=run.packing, use_distributed_optimizer=True, overlap_grad_reduce=True,
                 overlap_param_gather=True)
        if w.model in MOE_KINDS:
            r.update(moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")
    r.update(run.extra)
    if args.smoke:  # fp32 on CPU: param remainders (and the moments they keep) are a bf16 setting
        for key in ("store_param_remainders", "exp_avg_dtype", "exp_avg_sq_dtype"):
            r.pop(key, None)
    return r


def _has_liger() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _unavailable(run: Run, smoke: bool) -> str | None:
    if run.extra.get("enable_liger_kernel") and (smoke or not _has_liger()):
        return "Liger kernels need a GPU and liger-kernel installed"
    if run.extra.get("deepspeed") and (smoke or importlib.util.find_spec("deepspeed") is None):
        return "DeepSpeed needs GPUs and deepspeed installed"
    if run.extra.get("cuda_graphs") and smoke:
        return "CUDA graphs need GPUs"
    return None


LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
               "recompute_granularity", "store_param_remainders", "exp_avg_dtype", "cuda_graphs")


def _layout_of(run: Run) -> tuple:
    sizes = {k: run.extra.get(k) for k in LAYOUT_KEYS}
    for key in LAYOUT_KEYS[:6]:
        sizes[key] = sizes[key] or 1
    return run.gpus, run.micro_batch, tuple(sorted(sizes.items()))


def resolve_planned(w: Workload, run: Run, config, info: dict, peak: float | None, smoke: bool) -> tuple[Run, str]:
    """A ``planned`` run as the planner's first proposal for its GPUs and global batch, and the name of another run
    of the workload with that very layout ("" if none)."""
    from planner_check import planned

    from llamafactory_mca.planner.search import DEFAULT_PEAK

    memory = min(info.get("memory_gib") or [80.0]) if not smoke else 80.0
    keys, label = planned(config, w, run, w.cutoff, memory, peak or DEFAULT_PEAK)
    keys = {k: v for k, v in keys.items() if v not in (None, False) and not (k.endswith("_size") and v == 1)}
    micro, accum = keys.pop("per_device_train_batch_size"), keys.pop("gradient_accumulation_steps")
    resolved = Run(run.name, run.path, run.gpus, run.packing, micro, accum, label, keys)
    same = next((r.name for r in w.runs if r is not run and r.path == "ours" and not r.extra.get("planned")
                 and _layout_of(r) == _layout_of(resolved)), "")
    return resolved, same


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_devices(n: int, smoke: bool) -> str:
    if smoke:
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(n)]
    return ",".join(ids[:n])


def launch(run: Run, recipe_path: str, run_dir: str, timeout: int, smoke: bool, profile_step: int
           ) -> tuple[str, float]:
    """Start the run as LLaMA-Factory's launcher would; returns (status, seconds). Step ``profile_step`` runs under
    torch.profiler: it comes after the measured steps, so the profiler's overhead never reaches their rates."""
    torchrun = run.path == "ours" or run.gpus > 1  # the launcher forces torchrun under USE_MCA=1
    metrics = os.path.join(run_dir, "metrics")
    if torchrun:  # ours: our preflight and torchrun, as llamafactory-cli runs them under USE_MCA=1 (ranks forked)
        launcher = [LAUNCH] if run.path == "ours" else ["-m", "torch.distributed.run"]
        cmd = [sys.executable, *launcher, "--nnodes", "1", "--node_rank", "0",
               "--nproc_per_node", str(run.gpus), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               ENTRY, recipe_path]
    else:
        cmd = [sys.executable, ENTRY, recipe_path]
    # LLAMAFACTORY_MCA_DEBUG passes (tracebacks, which kernels compiled and how long), and the bench's --ops; our other
    # switches do not
    env = {k: v for k, v in os.environ.items() if k in ("LLAMAFACTORY_MCA_DEBUG", "E2E_BENCH_OPS")
           or not k.startswith(("USE_MCA", "LLAMAFACTORY_MCA_", "E2E_BENCH_"))}
    env.update(NPROC_PER_NODE=str(run.gpus), CUDA_VISIBLE_DEVICES=_visible_devices(run.gpus, smoke),
               HF_DATASETS_CACHE=os.path.join(run_dir, "datasets_cache"),  # every run tokenizes from scratch
               E2E_BENCH_OUT=metrics, E2E_BENCH_EXIT="1", E2E_BENCH_PACKED="1" if run.packing else "0",
               E2E_BENCH_PROFILE_STEP=str(profile_step))
    if run.path == "ours":
        env["USE_MCA"] = "1"
    if smoke:  # one BLAS thread per process: CPU numbers only check the harness, keep them steady and comparable
        env["OMP_NUM_THREADS"] = "1"
    if torchrun:  # what LLaMA-Factory's launcher adds for torchrun (OPTIM_TORCH, on by default)
        env.update(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", TORCH_NCCL_AVOID_RECORD_STREAMS="1")
    with open(recipe_path, encoding="utf-8") as f:
        settings = f.read()
    with open(os.path.join(run_dir, "command.txt"), "w", encoding="utf-8") as f:
        f.write(" ".join(f"{k}={env[k]}" for k in ("USE_MCA", "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES") if k in env)
                + " " + " ".join(cmd) + "\n" + settings)
    start = time.time()
    env["E2E_BENCH_T0"] = repr(start)
    with open(os.path.join(run_dir, "log.txt"), "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return "timeout", time.time() - start
    return ("ok" if rc == 0 else f"failed (exit {rc})"), time.time() - start


def _stop(proc: subprocess.Popen) -> None:
    """End the run we started: its process group (torchrun and its ranks), TERM then KILL."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _log_problem(run_dir: str) -> tuple[bool, str]:
    """(out of memory?, the most telling error line) from the run's log."""
    try:
        with open(os.path.join(run_dir, "log.txt"), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False, ""
    oom = any("out of memory" in line.lower() or "OutOfMemoryError" in line for line in lines)
    raised = re.compile(r"^\s*(\[rank\d+\]:\s*)?(([\w.]*(Error|Exception)|Traceback)\b|(?:[a-z_]\w*\.)+[A-Z]\w+: )")
    errors = [line.strip() for line in lines if raised.match(line) and "ChildFailedError" not in line
              and "Traceback (most recent call last)" not in line]
    return oom, (errors[-1] if errors else (lines[-1].strip() if lines else ""))[:300]


def _profile_summary(ranks: list[dict]) -> dict:
    """The profiled step's kernel time and launches, averaged over the ranks that recorded it (pipeline stages
    differ); None where no rank did, or where a rank ran no GPU. Its busy share is ``summarize``'s: the kernel time
    over an unprofiled step's time."""
    profiles = [s["profile"] for r in ranks for s in r["steps"] if s["step"] == r.get("profiled_step")
                and "profile" in s]
    result: dict[str, Any] = {"profiled_step": ranks[0].get("profiled_step") if profiles else None}
    for key in ("launches_per_step", "kernel_ms_per_step", "syncs_per_step"):
        values = [p.get(key) for p in profiles]
        result[key] = round(float(np.mean(values)), 4) if values and None not in values else None
    return result


def _batch_as_run(run_dir: str, run: Run) -> Run:
    """The run with the micro-batch and accumulation our startup summary names (``merge_micro_batches`` may run the
    recipe's micro-batches k as one); LLaMA-Factory's runs as declared."""
    try:
        with open(os.path.join(run_dir, "log.txt"), encoding="utf-8", errors="replace") as f:
            found = re.search(r"x micro batch (\d+) x grad accumulation (\d+)", f.read())
    except OSError:
        found = None
    if run.path != "ours" or not found:
        return run
    return dataclasses.replace(run, micro_batch=int(found.group(1)), grad_accum=int(found.group(2)))


def summarize(run_dir: str, run: Run, warmup: int, flops_config, peak: float | None) -> dict:
    """Throughput, MFU, memory, time to first step and losses from the ranks' files; the profiled step counts only
    for its busy share and launches."""
    from llamafactory_mca.models.cost import flops_per_sequence_set

    ranks = []
    metrics = os.path.join(run_dir, "metrics")
    for name in sorted(os.listdir(metrics)) if os.path.isdir(metrics) else []:
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(metrics, name), encoding="utf-8") as f:
                ranks.append(json.load(f))
    if not ranks:
        return {}
    first = min(ranks, key=lambda r: r["rank"])
    steps = {s["step"]: dict(s) for s in first["steps"] if "t_end" in s and s["step"] != first.get("profiled_step")}
    if first["token_scope"] == "rank":  # LLaMA-Factory path: add the ranks' tokens and sequences
        flops_config = flops_config.without_mtp()  # transformers drops multi-token prediction: it does not train it
        for s in steps.values():
            s["tokens"], s["flops"] = 0, 0.0
        for r in ranks:
            for s in r["steps"]:
                if s["step"] in steps and "tokens" in s:
                    steps[s["step"]]["tokens"] += s["tokens"]
                    steps[s["step"]]["flops"] += flops_per_sequence_set(flops_config.transformer,
                                                                         flops_config.vocab_size, s["seqlens"])
    result: dict[str, Any] = {
        "steps_done": len(steps),
        "first_step_s": round(max(r["first_step_s"] or 0.0 for r in ranks), 1) if first["first_step_s"] else None,
        # of which launch -> training begins (imports, data, model, optimizer); the rest is step 1 itself
        "train_begin_s": (round(max(r["train_begin_s"] for r in ranks), 1)
                          if all(r.get("train_begin_s") for r in ranks) else None),
        "peak_memory_gib": round(max(r["peak_memory_gib"] for r in ranks), 2) or None,
        "peak_reserved_gib": round(max(r["peak_reserved_gib"] for r in ranks), 2) or None,
        "losses": [round(steps[k]["loss"], 4) if "loss" in steps[k] else None for k in sorted(steps)],
        **_profile_summary(ranks),
        "gpu_busy": None,  # below, where the measured steps give an unprofiled step's time
    }
    window = [k for k in sorted(steps) if k > warmup and "tokens" in steps[k]]
    if warmup in steps and window:
        seconds = steps[window[-1]]["t_end"] - steps[warmup]["t_end"]
        tokens = sum(steps[k]["tokens"] for k in window)
        flops = sum(steps[k]["flops"] for k in window)
        result.update(measured_steps=len(window), seconds=round(seconds, 3), real_tokens=int(tokens),
                      tokens_per_second_per_gpu=round(tokens / seconds / run.gpus, 1),
                      mfu=round(flops / seconds / run.gpus / peak, 4) if peak else None,
                      step_seconds=round(seconds / len(window), 3))
        if result.get("kernel_ms_per_step") is not None:  # the profiled step's GPU work over an unprofiled step's time
            result["gpu_busy"] = round(result["kernel_ms_per_step"] / 1e3 / result["step_seconds"], 4)
        reported = [steps[k].get("self_reported", {}) for k in window]
        keys = [key for key in ("tokens_per_second_per_gpu", "mfu") if any(key in r for r in reported)]
        if keys:  # ours: McaTrainer's own log line (timed over train_step only), for cross-checking
            result["self_reported"] = {key: round(float(np.mean([r[key] for r in reported if key in r])), 4)
                                       for key in keys}
    return result


def run_workload(w: Workload, args, info: dict, save) -> dict:
    """Every run of ``w``; ``save(partial result)`` after each, so a cut-off invocation keeps what it measured."""
    from planner_check import predict

    from llamafactory_mca.models.auto import AutoConfig

    steps = args.steps or w.steps
    warmup = min(args.warmup if args.warmup is not None else w.warmup, steps - 1)
    layers = args.layers or w.layers or (2 if args.smoke else 28 if w.model == "dense" else 8 if w.model == "vl" else
                                         8 if min(info.get("memory_gib") or [0]) >= 120 else 4)
    config = model_config(w.model, layers, args.smoke)
    work = os.path.join(args.work, "smoke" if args.smoke else "gpu")
    cache = os.path.join(work, "cache")
    model_dir = prepare_model(config, args.smoke, cache)
    data_dir = prepare_dataset(w, steps, args.smoke, cache)
    flops_config = AutoConfig.from_pretrained(model_dir)
    peak = peak_flops_for(info["names"][0]) if info["names"] else None
    settings = {"model": ("tiny stand-in for " if args.smoke else "") + LABELS[w.model], "layers": layers,
                "cutoff_len": w.cutoff, "lengths": list(w.lengths),
                "steps": steps, "warmup": warmup, "lr": args.lr, "about": w.about, "smoke": args.smoke,
                "precision": "fp32 (CPU)" if args.smoke else "bf16", "peak_flops": peak,
                "comparable": digest([config, w.cutoff, list(w.lengths), steps, args.lr, args.smoke,
                                    info["names"][:1]])}
    runs = {}
    result = {"settings": settings, "machine": info, "versions": versions(), "runs": runs}
    for run in w.runs:
        if (args.paths and run.path not in args.paths) or (args.runs and run.name not in args.runs):
            continue
        if run.extra.get("planned") and run.gpus <= args.gpus:
            run, same_as = resolve_planned(w, run, flops_config, info, peak, args.smoke)
            if same_as:
                runs[run.name] = {"path": run.path, "gpus": run.gpus, "layout": run.layout, "packing": run.packing,
                                  "micro_batch": run.micro_batch, "grad_accum": run.grad_accum, "keys": run.extra,
                                  "status": f"skipped: the layout of `{same_as}`"}
                print(f"[e2e] {w.name}/{run.name}: {run.layout}: the layout of {same_as}, not run twice", flush=True)
                continue
        record = {"path": run.path, "gpus": run.gpus, "layout": run.layout, "packing": run.packing,
                  "micro_batch": run.micro_batch, "grad_accum": run.grad_accum}
        if run.path == "ours" and run.extra:
            record["keys"] = run.extra  # what planner_check predicts from
        why_not = _unavailable(run, args.smoke)
        if why_not:
            record["status"] = f"skipped: {why_not}"
            runs[run.name] = record
            print(f"[e2e] {w.name}/{run.name}: {record['status']}", flush=True)
            continue
        if run.gpus > args.gpus:
            record["status"] = f"skipped: needs {run.gpus} GPUs, {args.gpus} available"
            runs[run.name] = record
            print(f"[e2e] {w.name}/{run.name}: {record['status']}", flush=True)
            continue
        run_dir = os.path.join(work, "runs", w.name, run.name)
        if os.path.isdir(run_dir):
            shutil.rmtree(run_dir)
        os.makedirs(run_dir)
        recipe_path = os.path.join(run_dir, "recipe.yaml")
        with open(recipe_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(recipe(w, run, model_dir, data_dir, os.path.join(run_dir, "output"), steps, args), f)
        print(f"[e2e] {w.name}/{run.name}: {run.layout}, {run.gpus} x {'GPU' if not args.smoke else 'CPU process'}, "
              f"log {os.path.relpath(os.path.join(run_dir, 'log.txt'))}", flush=True)
        status, seconds = launch(run, recipe_path, run_dir, args.timeout, args.smoke, steps + 1)
        record.update(summarize(run_dir, run, warmup, flops_config, peak))
        ran = _batch_as_run(run_dir, run)
        if (ran.micro_batch, ran.grad_accum) != (run.micro_batch, run.grad_accum):  # merge_micro_batches
            record["ran_as"] = f"{ran.micro_batch} x {ran.grad_accum}"
        if run.path == "ours" and run.packing:  # the planner's estimate beside it, for the batch as it ran
            predicted = predict(flops_config, w, ran, w.cutoff, peak)
            record["predicted_peak_gib"] = predicted["peak"]
            record["predicted_tokens_per_s"] = predicted.get("tokens_per_s")
        oom, problem = _log_problem(run_dir)
        if status != "ok":
            record["error"] = problem
            status = "OOM" if oom else status
        elif record.get("steps_done", 0) < steps:
            status = "incomplete"
        record.update(status=status, wall_s=round(seconds, 1),
                      log=os.path.relpath(os.path.join(run_dir, "log.txt"), args.work))  # under --work
        runs[run.name] = record
        print(f"[e2e] {w.name}/{run.name}: {_one_line(record)} ({seconds:.0f} s)", flush=True)
        save(result | {"finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    return result | {"finished": time.strftime("%Y-%m-%d %H:%M:%S")}


def _one_line(r: dict) -> str:
    parts = [r["status"]]
    if r.get("tokens_per_second_per_gpu") is not None:
        parts.append(f"{r['tokens_per_second_per_gpu']:,.1f} tok/s/GPU")
    if r.get("mfu") is not None:
        parts.append(f"MFU {r['mfu']:.1%}")
    if r.get("peak_memory_gib"):
        parts.append(f"peak {r['peak_memory_gib']:.1f} GiB")
    if r.get("first_step_s") is not None:
        parts.append(f"first step {r['first_step_s']:.1f} s" + (
            f" (training began at {r['train_begin_s']:.1f} s)" if r.get("train_begin_s") else ""))
    if r.get("gpu_busy") is not None:
        parts.append(f"GPU busy {r['gpu_busy']:.0%}, {r['launches_per_step']:,.0f} launches/step")
    losses = [x for x in r.get("losses", []) if x is not None]
    if losses:
        parts.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if r.get("error"):
        parts.append(r["error"][:160])
    return ", ".join(parts)
