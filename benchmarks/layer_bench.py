"""One decoder layer, forward + backward: native spec vs Megatron's local spec (time and peak memory).

Qwen3-shaped dense and MoE layers at 4k/16k/32k tokens, one process, one GPU. Implementations:

- ``local``: Megatron's local spec, padded batch of one sequence (materialises [b, h, s, s] scores);
- ``native``: the native spec, the same padded batch (SDPA);
- ``native-thd``: the native spec, the same tokens packed as sequences of at most 4096 (varlen_attn).

Writes ``layer_bench.json`` and ``layer_bench.md`` to ``--out``. An out-of-memory case is recorded as OOM.
``--smoke`` runs tiny shapes (on CPU when there is no GPU) to check the script itself.

    python benchmarks/layer_bench.py --out $OUT/layer
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMPLS = ("local", "native", "native-thd")


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    head_dim: int = 128


FULL = [
    Shape("dense", 2048, 16, 8, 6144),                     # Qwen3-1.7B
    Shape("dense", 4096, 32, 8, 12288),                    # Qwen3-8B
    Shape("moe", 2048, 32, 4, 6144, 128, 8, 768),          # Qwen3-30B-A3B
    Shape("moe", 4096, 64, 4, 12288, 128, 8, 1536),        # Qwen3-235B-A22B
]
SMOKE = [Shape("dense", 64, 4, 2, 128, head_dim=16), Shape("moe", 64, 4, 2, 128, 8, 2, 32, head_dim=16)]


def build_layer(shape: Shape, impl: str, dtype: torch.dtype, cpu: bool):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from llamafactory_mca.models import spec

    kwargs = dict(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.heads, num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn, normalization="RMSNorm", qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=dtype is torch.bfloat16, params_dtype=dtype, use_cpu_initialization=cpu,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        bias_activation_fusion=not cpu, apply_rope_fusion=False,
        attention_backend="local" if impl == "local" else "auto",
    )
    if shape.experts:
        kwargs.update(num_moe_experts=shape.experts, moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.moe_ffn,
                      moe_grouped_gemm=impl != "local", moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32")
    spec.prepare_config(kwargs)
    config = TransformerConfig(**kwargs)
    layer = build_module(spec.get_layer_spec(config), config=config, layer_number=1)
    return layer.to("cpu" if cpu else "cuda"), config


def run_case(shape: Shape, impl: str, tokens: int, dtype: torch.dtype, cpu: bool, warmup: int, iters: int) -> dict:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import PackedSeqParams

    device = "cpu" if cpu else "cuda"
    record = {"kind": shape.name, "hidden": shape.hidden, "tokens": tokens, "impl": impl}
    try:
        layer, _ = build_layer(shape, impl, dtype, cpu)
        params = None
        seq_len = tokens
        if impl == "native-thd":
            seq_len = min(tokens, 4096)
            cu = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device=device)
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seq_len,
                                     max_seqlen_kv=seq_len)
        rope = RotaryEmbedding(shape.head_dim, rotary_percent=1.0, rotary_base=1_000_000,
                               use_cpu_initialization=True).to(device)
        emb = rope(seq_len)
        hidden = torch.randn(tokens, 1, shape.hidden, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(hidden)

        def step():
            out, _ = layer(hidden, attention_mask=None, rotary_pos_emb=emb, packed_seq_params=params)
            out.backward(grad)

        for _ in range(warmup):
            step()
        _release_buffers(cpu)  # the local spec keeps its [b·h, s, s] score buffer there: count it when measuring
        if not cpu:
            torch.cuda.reset_peak_memory_stats()
        base = 0 if cpu else torch.cuda.memory_allocated()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(cpu)
        record.update(status="ok", ms=round((time.perf_counter() - start) * 1000 / iters, 2),
                      peak_gib=None if cpu else round((torch.cuda.max_memory_allocated() - base) / 2**30, 3))
    except torch.OutOfMemoryError:
        record.update(status="OOM", ms=None, peak_gib=None)
    except Exception as err:  # noqa: BLE001 - one broken case must not lose the others
        record.update(status=f"error: {type(err).__name__}: {str(err)[:200]}", ms=None, peak_gib=None)
    finally:
        layer = hidden = grad = None  # drop this case's tensors before the next one
        _release_buffers(cpu)
    return record


def _sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def _release_buffers(cpu: bool) -> None:
    from megatron.core import parallel_state

    _sync(cpu)
    parallel_state.get_global_memory_buffer().buffer.clear()
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()


def markdown(records: list[dict], describe: str) -> str:
    rows = {}
    for r in records:
        rows.setdefault((r["kind"], r["hidden"], r["tokens"]), {})[r["impl"]] = r

    def cell(r):
        if r is None:
            return "-"
        if r["status"] != "ok":
            return r["status"]
        return f"{r['ms']:.1f} ms" + (f" / {r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "")

    lines = [f"Forward + backward of one decoder layer. {describe}", "",
             "| layer | hidden | tokens | local | native (SDPA) | native-thd (varlen, ≤4k seqs) | native speed-up |",
             "|---|---|---|---|---|---|---|"]
    for (kind, hidden, tokens), by_impl in rows.items():
        local, native = by_impl.get("local"), by_impl.get("native")
        if native and native["status"] == "ok" and local and local["status"] == "ok":
            speedup = f"{local['ms'] / native['ms']:.1f}x"
        elif native and native["status"] == "ok" and local and local["status"] == "OOM":
            speedup = "local OOM"
        else:
            speedup = "-"
        lines.append(f"| {kind} | {hidden} | {tokens} | {cell(local)} | {cell(native)} | "
                     f"{cell(by_impl.get('native-thd'))} | {speedup} |")
    return "\n".join(lines) + "\n"


def write(out: str, device: str, records: list[dict], describe: str) -> None:
    with open(os.path.join(out, "layer_bench.json"), "w", encoding="utf-8") as f:
        json.dump({"device": device, "torch": torch.__version__, "records": records}, f, indent=2)
    with open(os.path.join(out, "layer_bench.md"), "w", encoding="utf-8") as f:
        f.write(markdown(records, describe))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for layer_bench.json and layer_bench.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU allowed: checks the script")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (default 4096,16384,32768)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    from llamafactory_mca import parallel

    parallel.initialize(parallel.ParallelLayout(world_size=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=1,
                                                expert_dp=1, micro_batch_size=1, grad_accum=1))
    cpu = not torch.cuda.is_available()
    if cpu and not args.smoke:
        parser.error("no CUDA GPU: the benchmark needs one (use --smoke to check the script on CPU)")
    shapes = SMOKE if args.smoke else FULL
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([128, 256] if args.smoke
                                                                            else [4096, 16384, 32768])
    dtype = torch.float32 if cpu else torch.bfloat16
    device = "CPU (smoke)" if cpu else torch.cuda.get_device_name()
    describe = f"{device}, torch {torch.__version__}, {str(dtype).replace('torch.', '')}; time / peak memory above "
    describe += "the layer's weights and gradients."
    os.makedirs(args.out, exist_ok=True)
    records = []
    for shape in shapes:
        for n in tokens:
            for impl in IMPLS:
                for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
                    os.environ.pop(name, None)  # Megatron pins these per backend; we build both in one process
                records.append(run_case(shape, impl, n, dtype, cpu, args.warmup, args.iters))
                print(json.dumps(records[-1]), flush=True)
                write(args.out, device, records, describe)  # after every case: a cut-off run keeps what it measured
    print(markdown(records, describe))
    parallel.destroy()


if __name__ == "__main__":
    main()
