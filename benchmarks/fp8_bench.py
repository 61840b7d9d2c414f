"""One linear layer's forward + backward in FP8 (``models/native/fp8.py``) against Megatron's bf16 function.

Per GEMM shape of a Qwen3-8B layer at one 4,096-token pack (``qkv``: 4096 -> 6144, ``proj``: 4096 -> 4096, ``fc1``:
4096 -> 24576, ``fc2``: 12288 -> 4096), each way a covered linear can run:

- ``bf16``: Megatron's ``linear_with_grad_accumulation_and_async_allreduce``, its weight gradient GEMMed into the
  fp32 ``main_grad`` (``gradient_accumulation_fusion``, as our runs on a GPU);
- ``tensorwise`` / ``rowwise`` (E4M3, gradients E5M2: ``hybrid``), their weight gradient in FP8 added to ``main_grad``;
  ``tensorwise_bf16_wgrad``: ``fp8_wgrad: false``;
- ``frozen_*``: a frozen weight (LoRA's base): forward and input gradient only;
- ``*_held``: the weight's casts kept from an earlier call (``fp8.WeightCasts`` inside a step: every micro-batch
  after the first).

Median milliseconds of forward + backward over ``--repeat`` runs after warm-ups, the speed-up over bf16 and the
peak memory the call adds. Writes ``fp8.json`` and ``fp8.md`` to ``--out``.

``--experts``: the grouped experts instead (``models/native/experts.py``), Qwen3-30B-A3B's (128 experts, 2048 ->
2 x 768 -> 2048) and Qwen3-235B-A22B's (128, 4096 -> 2 x 1536 -> 4096) at several rows per expert: bf16
(``torch._grouped_mm``, the weight gradient into ``main_grad``) against FP8 (``torch._scaled_grouped_mm`` for the
forward and the input gradient where ``fp8.grouped_pays``, the weights' casts held as inside a step), forward +
backward; and the forward GEMM alone on operands already cast (``gemm_*``, FP8 whatever the rows). Writes
``fp8_experts.json`` and ``.md``.

    python benchmarks/fp8_bench.py --out $OUT/fp8 [--experts]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attention_bench import median_ms  # noqa: E402  (benchmarks/: the script's own folder)


HELD = contextlib.ExitStack()
SHAPES = {"qkv": (4096, 6144), "proj": (4096, 4096), "fc1": (4096, 24576), "fc2": (12288, 4096)}
TOKENS = 4096


def _setup() -> None:
    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    torch.cuda.set_device(0)


def _ways() -> dict:
    from megatron.core.tensor_parallel.layers import (
        linear_with_frozen_weight,
        linear_with_grad_accumulation_and_async_allreduce,
    )

    from llamafactory_mca.models.native import fp8, install

    install()  # Megatron's wgrad GEMM into main_grad without apex
    hybrid = dict(format="hybrid")

    def megatron(x, w):  # what ColumnParallelLinear._forward_impl picks
        if not w.requires_grad:
            return linear_with_frozen_weight(x, w, None, False, False, False, None)
        return linear_with_grad_accumulation_and_async_allreduce(x, w, None, True, False, False)

    def ours(settings, held=False):
        casts = fp8.WeightCasts()
        if held:  # for the rest of the process: as the micro-batches of one long step
            HELD.enter_context(casts.holding())
        return lambda x, w: fp8._Fp8Linear.apply(x, w, None, settings, casts, w.requires_grad, False, False, None)

    tensorwise, rowwise = fp8.Fp8Training(**hybrid), fp8.Fp8Training(recipe="rowwise", **hybrid)
    return {"bf16": (megatron, True), "tensorwise": (ours(tensorwise), True),
            "tensorwise_held": (ours(tensorwise, held=True), True), "rowwise": (ours(rowwise), True),
            "rowwise_held": (ours(rowwise, held=True), True),
            "tensorwise_bf16_wgrad": (ours(fp8.Fp8Training(wgrad=False, **hybrid)), True),
            "frozen_bf16": (megatron, False), "frozen_tensorwise": (ours(tensorwise), False),
            "frozen_tensorwise_held": (ours(tensorwise, held=True), False), "frozen_rowwise": (ours(rowwise), False)}


def _profile(shape: str, way: str, fn, trainable: bool, out: str) -> None:
    """The kernels of five forward + backward calls of one way, by GPU time (``--profile``)."""
    from torch.profiler import ProfilerActivity, profile

    step = _case(shape, way, fn, trainable, 1, keep=True)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
    with open(os.path.join(out, f"profile_{shape}_{way}.txt"), "w") as f:
        f.write(table)
    print(f"== profile {shape} {way}\n{table}", flush=True)


def _case(shape: str, way: str, fn, trainable: bool, repeat: int, keep: bool = False):
    k, n = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, 1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.nn.Parameter(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02,
                           requires_grad=trainable)
    if trainable:
        w.main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
    grad = torch.randn(TOKENS, 1, n, device="cuda", dtype=torch.bfloat16, generator=g)
    xs = x.clone().requires_grad_(True)

    def step():
        xs.grad = None
        fn(xs, w).backward(grad)

    step()
    torch.cuda.synchronize()
    if keep:
        return step
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    ms = median_ms(step, repeat, warmup=3)
    flops = 2 * TOKENS * k * n * (3 if trainable else 2)
    return {"shape": shape, "way": way, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
            "extra_mib": round(extra, 1)}


# Qwen3-30B-A3B's experts, and Qwen3-235B-A22B's (``*_wide``): 128 of them either way
EXPERTS = 128
EXPERT_SHAPES = {"fc1": (2048, 1536), "fc2": (768, 2048), "fc1_wide": (4096, 3072), "fc2_wide": (1536, 4096)}
ROWS_PER_EXPERT = (128, 256, 512, 1024, 2048)


def _expert_cases(repeat: int) -> list[dict]:
    from llamafactory_mca.models.native import experts, fp8

    e4m3 = torch.float8_e4m3fn
    casts = fp8.WeightCasts()
    HELD.enter_context(casts.holding())
    rows = []
    for shape, (k, n) in EXPERT_SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        param = torch.nn.Parameter(torch.randn(EXPERTS * k * n, device="cuda", dtype=torch.bfloat16, generator=g)
                                   * 0.02)
        param.main_grad = torch.zeros(param.shape, device="cuda", dtype=torch.float32)
        weights = param.view(EXPERTS, k, n)
        b, scale_b = fp8.stacked_operand(weights.detach(), e4m3, 1)
        for per_expert in ROWS_PER_EXPERT:
            tokens = EXPERTS * per_expert
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
            grad = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=g)
            offs = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * per_expert
            a = fp8.per_row(x.detach(), e4m3, 1)
            ways = {"bf16": lambda: experts._GroupedMMIntoMainGrad.apply(x, param, offs, weights.shape).backward(grad),
                    "fp8": lambda: experts._Fp8GroupedMM.apply(x, param, offs, weights.shape, True, casts
                                                               ).backward(grad),
                    "gemm_bf16": lambda: torch._grouped_mm(x.detach(), weights.detach(), offs=offs),
                    "gemm_fp8": lambda: fp8.grouped_mm(a, b, scale_b, offs, torch.bfloat16)}
            for way, fn in ways.items():
                ms = median_ms(fn, repeat, warmup=3)
                flops = 2 * tokens * k * n * (3 if way in ("bf16", "fp8") else 1)
                rows.append({"shape": shape, "rows_per_expert": per_expert, "way": way, "ms": round(ms, 3),
                             "tflops": round(flops / ms / 1e9, 1)})
                print(json.dumps(rows[-1]), flush=True)
    base = {(r["shape"], r["rows_per_expert"], r["way"].startswith("gemm")): r["ms"] for r in rows
            if r["way"] in ("bf16", "gemm_bf16")}
    for r in rows:
        r["speedup"] = round(base[(r["shape"], r["rows_per_expert"], r["way"].startswith("gemm"))] / r["ms"], 2)
    return rows


def _write(out: str, name: str, title: str, meta: dict, rows: list[dict], columns: list[str], cells) -> None:
    """``name``.json (the rows and ``meta``) and ``name``.md (a table of ``cells(row)`` under ``columns``)."""
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"machine": machine, **meta, "rows": rows}, f, indent=1)
    lines = [f"# {title} ({machine})", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in rows]
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--profile", default="", help="SHAPE:WAY,...: profile these instead of timing all")
    parser.add_argument("--experts", action="store_true", help="the grouped experts instead of the linears")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    _setup()
    if args.experts:
        _write(args.out, "fp8_experts", f"FP8 grouped experts against bf16 ({EXPERTS} experts)",
               {"experts": EXPERTS}, _expert_cases(args.repeat),
               ["GEMM (k -> n)", "rows per expert", "way", "ms", "TFLOP/s", "speed-up"],
               lambda r: (f"{r['shape']} {EXPERT_SHAPES[r['shape']]}", r["rows_per_expert"], r["way"], r["ms"],
                          r["tflops"], f"{r['speedup']}x"))
        torch.distributed.destroy_process_group()
        return
    if args.profile:
        ways = _ways()
        for item in args.profile.split(","):
            shape, way = item.split(":")
            _profile(shape, way, *ways[way], args.out)
        return
    rows = []
    for shape in SHAPES:
        for way, (fn, trainable) in _ways().items():
            rows.append(_case(shape, way, fn, trainable, args.repeat))
            print(json.dumps(rows[-1]), flush=True)
    base = {(r["shape"], r["way"].startswith("frozen")): r["ms"] for r in rows if r["way"] in ("bf16", "frozen_bf16")}
    for r in rows:
        r["speedup"] = round(base[(r["shape"], r["way"].startswith("frozen"))] / r["ms"], 2)
    _write(args.out, "fp8", f"FP8 linears against Megatron's bf16 function ({TOKENS} tokens, forward + backward)",
           {"tokens": TOKENS}, rows, ["shape (in -> out)", "way", "ms", "TFLOP/s", "speed-up", "extra MiB"],
           lambda r: (f"{r['shape']} {SHAPES[r['shape']]}", r["way"], r["ms"], r["tflops"], f"{r['speedup']}x",
                      r["extra_mib"]))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
