"""The gated delta rule alone, forward + backward: transformers' torch rule against ours (and fla where it is usable).

Qwen3-Next-80B-A3B's linear-attention heads (16 key heads, 32 value heads, 128 x 128) on 16k tokens, two ways:

- ``padded``: 4 rows of 4,096 tokens, each one sequence;
- ``packed``: one row of 16,384 tokens holding sequences of log-uniform length 32..4,096; transformers' rule runs them
  side by side as a batch padded to the longest (how this package ran it before ``delta_rule.py``), ours and fla take
  ``cu_seqlens``.

Median time of ``--repeat`` runs after one warm-up, and peak memory above the inputs. Writes ``delta_rule.json`` and
``delta_rule.md`` to ``--out``; ``--smoke`` runs tiny shapes (on the CPU when there is no GPU).

    python benchmarks/delta_rule_bench.py --out $OUT/delta_rule
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lengths(total: int, low: int, high: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.empty(1).uniform_(torch.tensor(low).log(), torch.tensor(high).log(),
                                                   generator=g).exp()))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def _side_by_side(q, k, v, g, beta, cu):
    """transformers' rule over the pack's sequences as a zero-padded batch (our rule before delta_rule.py)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k = (t.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for t in (q, k))
    if cu is None:
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    starts, lengths = cu[:-1], cu.diff()
    offsets = torch.arange(int(lengths.max()), device=q.device)
    inside = offsets < lengths[:, None]
    index = (starts[:, None] + offsets).clamp(max=q.shape[1] - 1)

    def rows(t):
        r = t[0][index]
        return r * inside.view(*inside.shape, *[1] * (r.dim() - 2)).to(r.dtype)

    return torch_chunk_gated_delta_rule(*map(rows, (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0][inside][None]


def _impls(device: torch.device) -> dict:
    from llamafactory_mca.models.native.delta_rule import chunked_delta_rule
    from llamafactory_mca.models.native.gated_delta import _fla_rule, fla_usable

    impls = {"transformers": _side_by_side, "ours": chunked_delta_rule}
    if device.type == "cuda" and fla_usable():
        impls["fla"] = lambda q, k, v, g, beta, cu: _fla_rule()(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                               cu_seqlens=cu)[0]
    return impls


def _inputs(rows: int, tokens: int, nk: int, nv: int, dk: int, dv: int, dtype, device):
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    q, k, v = rand(rows, tokens, nk, dk), rand(rows, tokens, nk, dk), rand(rows, tokens, nv, dv)
    decay = -torch.nn.functional.softplus(rand(rows, tokens, nv))
    beta = rand(rows, tokens, nv).sigmoid()
    return [t.to(dtype).requires_grad_(True) for t in (q, k, v)] + [decay.requires_grad_(True),
                                                                    beta.to(dtype).requires_grad_(True)]


def _time(fn, args, cu, repeat: int, device) -> tuple[float, float]:
    def once():
        out = fn(*args, cu)
        out.float().square().mean().backward()

    once()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    for _ in range(repeat):
        for t in args:
            t.grad = None
        start = time.perf_counter()
        once()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        heads, total, longest, dtype = (2, 4, 16, 16), 512, 256, torch.float32
    else:
        heads, total, longest, dtype = (16, 32, 128, 128), 16384, 4096, torch.bfloat16
    lengths = _lengths(total, 32, longest)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    workloads = {"padded": (total // longest, longest, None), "packed": (1, total, cu)}
    results = []
    for workload, (rows, tokens, bounds) in workloads.items():
        inputs = _inputs(rows, tokens, *heads, dtype, device)
        for name, fn in _impls(device).items():
            try:
                seconds, peak = _time(fn, inputs, bounds, args.repeat, device)
                results.append({"workload": workload, "impl": name, "ms": round(seconds * 1e3, 2),
                                "tokens_per_s": round(rows * tokens / seconds), "peak_gib": round(peak, 2)})
            except torch.OutOfMemoryError:
                results.append({"workload": workload, "impl": name, "ms": None, "status": "OOM"})
            print(results[-1], flush=True)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    meta = {"device": device_name, "torch": torch.__version__, "heads (nk, nv, dk, dv)": heads, "tokens": total,
            "packed lengths": len(lengths), "longest": max(lengths), "dtype": str(dtype), "repeat": args.repeat}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "delta_rule.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    base = {r["workload"]: r["ms"] for r in results if r["impl"] == "transformers"}
    lines = ["# Gated delta rule, forward + backward", "", ", ".join(f"{k}: {v}" for k, v in meta.items()), "",
             "| workload | rule | ms | tokens/s | peak GiB above inputs | vs transformers |",
             "|---|---|---|---|---|---|"]
    for r in results:
        speedup = f"{base[r['workload']] / r['ms']:.2f}x" if r.get("ms") and base.get(r["workload"]) else "-"
        lines.append(f"| {r['workload']} | {r['impl']} | {r.get('ms') or r.get('status')} | "
                     f"{r.get('tokens_per_s', '-'):,} | {r.get('peak_gib', '-')} | {speedup} |")
    with open(os.path.join(args.out, "delta_rule.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
