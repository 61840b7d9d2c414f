"""Causal attention kernels side by side, forward + backward: torch's flash (what runs today) against cuDNN's.

Our packed attention calls ``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2 on torch 2.11. cuDNN's fused
attention is reachable without Transformer Engine: SDPA's ``CUDNN_ATTENTION`` backend for one sequence per row, and
``aten._cudnn_attention_forward`` / ``_backward`` with cumulative lengths for packed rows (what torch 2.14's
varlen_attn calls where cuDNN >= 9.18, without GQA). This measures whether switching pays and by how much:

- ``dense_4k``: Qwen3-1.7B's heads (16 query, 8 key/value, dim 128), a 4,096-token pack of log-uniform lengths;
- ``moe_4k``: Qwen3-30B-A3B's heads (32 / 4, dim 128), the same kind of pack;
- ``long_32k``: Qwen3-1.7B's heads, one 32,768-token sequence.

Each kernel: median milliseconds of forward and of forward + backward over ``--repeat`` runs after two warm-ups,
TFLOP/s of forward + backward (causal: half the score matrix; backward 2.5 forwards), and the largest difference of
its output and query gradient from flash's, relative to flash's largest value. GQA on cuDNN either as cuDNN takes it
or with the key/value heads repeated (the ``_rep`` rows); each kernel runs in its own process. Writes
``attention.json`` and ``attention.md`` to ``--out``.

    python benchmarks/attention_bench.py --out $OUT/attention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llamafactory_mca.models.native.kernels import SegmentPlan, segment_attention  # noqa: E402


CASES = {
    "dense_4k": dict(heads=16, kv_heads=8, dim=128, tokens=4096, single=False),
    "moe_4k": dict(heads=32, kv_heads=4, dim=128, tokens=4096, single=False),
    "long_32k": dict(heads=16, kv_heads=8, dim=128, tokens=32768, single=True),
}


def _lengths(total: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(torch.empty(1).uniform_(4.0, 8.3, generator=g).exp()))  # ~55 .. ~4,000 tokens
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def _flash_varlen(q, k, v, cu, max_len):
    """Our packed path as it runs today: ``segment_attention`` over the pack's boundaries (varlen_attn on a GPU)."""
    plan = SegmentPlan(cu_q=cu, cu_k=cu, max_q=max_len, max_k=max_len, q_lens=(), k_lens=())
    return segment_attention(q, k, v, plan, q.size(-1) ** -0.5)


class _CudnnVarlen(torch.autograd.Function):
    """aten's cuDNN attention over cumulative lengths, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len):
        result = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)
        out, lse, seed, offset = result[0], result[1], result[6], result[7]
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad_out=grad.contiguous(), query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed,
            philox_offset=offset, attn_bias=None, cum_seq_q=cu, cum_seq_k=cu, max_q=ctx.max_len,
            max_k=ctx.max_len, dropout_p=0.0, is_causal=True)
        return dq, dk, dv, None, None


def _repeat(k, v, heads):
    rep = heads // k.size(1)
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _single(backend, repeat=False):
    def run(q, k, v, cu, max_len):
        if repeat:
            k, v = _repeat(k, v, q.size(1))
        qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, t, d]
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=kt.size(1) != qt.size(1))
        return out[0].transpose(0, 1)
    return run


def _cudnn_varlen(repeat=False):
    def run(q, k, v, cu, max_len):
        if repeat:
            k, v = _repeat(k, v, q.size(1))
        return _CudnnVarlen.apply(q, k, v, cu, max_len)
    return run


def _kernels(single: bool) -> dict:
    kernels = {"flash_varlen": _flash_varlen, "cudnn_varlen": _cudnn_varlen(), "cudnn_varlen_rep": _cudnn_varlen(True)}
    if single:
        kernels.update(flash_sdpa=_single(SDPBackend.FLASH_ATTENTION), cudnn_sdpa=_single(SDPBackend.CUDNN_ATTENTION),
                       cudnn_sdpa_rep=_single(SDPBackend.CUDNN_ATTENTION, repeat=True))
    return kernels


def median_ms(fn, repeat: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` on the GPU over ``repeat`` calls after ``warmup`` (fp8_bench.py's timer too)."""
    times = []
    for i in range(repeat + warmup):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _case(name: str, kernel: str, heads: int, kv_heads: int, dim: int, tokens: int, single: bool, repeat: int
          ) -> dict:
    lengths = [tokens] if single else _lengths(tokens)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    max_len = max(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    grad = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    row = {"case": name, "kernel": kernel, "sequences": len(lengths), "max_len": max_len}
    fn = _kernels(single)[kernel]
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(qs, ks, vs, cu, max_len)
    out.backward(grad)
    if kernel != "flash_varlen":  # against flash's output and query gradient on the same inputs
        rq = q.clone().requires_grad_(True)
        ref = _flash_varlen(rq, k, v, cu, max_len)
        ref.backward(grad)
        row["out_diff"] = float((out.detach().float() - ref.detach().float()).abs().max() / ref.detach().abs().max())
        row["dq_diff"] = float((qs.grad.float() - rq.grad.float()).abs().max() / rq.grad.float().abs().max())

    def forward():
        with torch.no_grad():
            fn(q, k, v, cu, max_len)

    def both():
        qs.grad = ks.grad = vs.grad = None
        fn(qs, ks, vs, cu, max_len).backward(grad)

    row["fwd_ms"] = median_ms(forward, repeat)
    row["fwd_bwd_ms"] = median_ms(both, repeat)
    row["tflops"] = sum(4 * n * n / 2 * heads * dim for n in lengths) * 3.5 / row["fwd_bwd_ms"] / 1e9
    row["status"] = "ok"
    return row


def _isolated(case: str, kernel: str, repeat: int) -> dict:
    """One kernel in its own process: a kernel that faults (an illegal address poisons the CUDA context) is a row
    that says so, and the others still run."""
    cmd = [sys.executable, __file__, "--one", f"{case}:{kernel}", "--repeat", str(repeat)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    error = [line for line in done.stderr.splitlines() if "Error" in line] or ["exit " + str(done.returncode)]
    return {"case": case, "kernel": kernel, "sequences": "", "max_len": "", "status": error[-1][:160]}


def number(key: str, fmt: str):
    """A table cell: the row's ``key`` formatted, empty where the row has none."""
    return lambda r: format(r[key], fmt) if key in r else ""


def markdown_table(title: str, meta: dict, columns: list[tuple[str, object]], rows: list[dict]) -> str:
    """``columns``: (header, the cell of a row)."""
    lines = [f"# {title}", "", meta["machine"] + "; " + meta["versions"], "",
             "| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _markdown(meta: dict, rows: list[dict]) -> str:
    return markdown_table("Causal attention kernels, forward + backward", meta, [
        ("case", lambda r: r["case"]), ("kernel", lambda r: r["kernel"]),
        ("sequences (max)", lambda r: f"{r['sequences']} ({r['max_len']})"), ("fwd ms", number("fwd_ms", ".3f")),
        ("fwd+bwd ms", number("fwd_bwd_ms", ".3f")), ("TFLOP/s", number("tflops", ".0f")),
        ("out diff", number("out_diff", ".1e")), ("dq diff", number("dq_diff", ".1e")),
        ("status", lambda r: r["status"])], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/attention")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # case:kernel, run in this process (see _isolated)
    args = parser.parse_args()
    if args.one:
        case, kernel = args.one.split(":")
        print(json.dumps(_case(case, kernel, repeat=args.repeat, **CASES[case])))
        return
    meta = {"machine": f"1 x {torch.cuda.get_device_name()}",
            "versions": f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}"}
    rows = [_isolated(c, k, args.repeat) for c in args.cases.split(",") for k in _kernels(CASES[c]["single"])]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    text = _markdown(meta, rows)
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
