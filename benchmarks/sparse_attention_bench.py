"""GLM-5's DeepSeek sparse attention against dense causal attention, one layer's core attention, forward + backward.

GLM-5 (``glm_moe_dsa``) picks, per query, the ``index_topk`` (2,048) keys its lightning indexer scores best; a query
with no more keys than that sees them all. Ours (``models/native/sparse_attention.py``, no Transformer Engine): the
dense attention for every query (a query among the first 2,048 sees every key), then for the later ones the
indexer's fp32 scores and a stable sort per chunk of queries, and SDPA over a boolean mask of the chosen keys. Dense:
the same q, k, v through the flash kernel our dense layers call (``segment_attention``). GLM-5's heads: 64 of 192 + 64
(RoPE) for queries and keys, 256 for values; the indexer's 32 heads of 128 on the 6,144-wide input and the 2,048-wide
low-rank query. One sequence per case (a packed document).

Each row: median milliseconds of forward and of forward + backward over ``--repeat`` runs (after a first
forward + backward and the one measuring memory), the peak
memory of forward + backward beyond the inputs, the keys a query sees on average, and the largest difference of the
sparse output from the dense one relative to the dense one's largest value (0 up to 2,048 tokens: every key chosen).
Writes ``sparse_attention.json`` and ``.md`` to ``--out``.

    python benchmarks/sparse_attention_bench.py --out $OUT/sparse_attention
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import MLATransformerConfig


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attention_bench import markdown_table, median_ms, number  # noqa: E402

from llamafactory_mca.models.native.kernels import make_plan, segment_attention  # noqa: E402
from llamafactory_mca.models.native.sparse_attention import NativeSparseAttention  # noqa: E402


GLM_5 = dict(hidden=6144, heads=64, qk=192 + 64, v=256, q_rank=2048, rope=64, index_heads=32, index_dim=128,
             topk=2048)
LENGTHS = (2048, 8192, 32768)
SPARSE = "sparse (indexer + masked SDPA)"


def _config(shape: dict, on_gpu: bool) -> MLATransformerConfig:
    return MLATransformerConfig(
        num_layers=1, hidden_size=shape["hidden"], num_attention_heads=shape["heads"], q_lora_rank=shape["q_rank"],
        kv_lora_rank=512, qk_head_dim=shape["qk"] - shape["rope"], qk_pos_emb_head_dim=shape["rope"],
        v_head_dim=shape["v"], experimental_attention_variant="dsa", dsa_indexer_n_heads=shape["index_heads"],
        dsa_indexer_head_dim=shape["index_dim"], dsa_indexer_topk=shape["topk"], rotary_base=1e6,
        params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=not on_gpu, attention_dropout=0.0)


def _case(shape: dict, n: int, repeat: int, device: str) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, device=device, dtype=torch.bfloat16, generator=g)

    q, k, v = rand(n, shape["heads"], shape["qk"]), rand(n, shape["heads"], shape["qk"]), rand(n, shape["heads"],
                                                                                                shape["v"])
    x, qr, grad = rand(n, 1, shape["hidden"]), rand(n, 1, shape["q_rank"]), rand(n, shape["heads"] * shape["v"])
    sparse = NativeSparseAttention(_config(shape, device == "cuda"), 1, AttnMaskType.causal, "self",
                                   softmax_scale=shape["qk"] ** -0.5).to(device)
    cu = torch.tensor([0, n], device=device, dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
    plan = make_plan([n], [n], device)
    kernels = {
        "dense (flash)": lambda a, b, c: segment_attention(a, b, c, plan, shape["qk"] ** -0.5).flatten(1),
        SPARSE: lambda a, b, c: sparse(a, b, c, None, x=x, qr=qr, packed_seq_params=packed),
    }
    chosen = sum(min(t + 1, shape["topk"]) for t in range(n)) / n
    keys = {name: chosen for name in kernels} | {"dense (flash)": (n + 1) / 2}
    rows, reference = [], None
    for name, fn in kernels.items():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad)
        row = {"tokens": n, "attention": name, "keys_per_query": keys[name]}
        if reference is None:
            reference = out.detach().float()
        else:
            row["out_diff"] = float((out.detach().float() - reference).abs().max() / reference.abs().max())
        del out, leaves

        def forward():
            with torch.no_grad():
                fn(q, k, v)

        def both():
            fn(*(t.detach().requires_grad_(True) for t in (q, k, v))).backward(grad)

        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            both()
            row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            row["fwd_ms"], row["fwd_bwd_ms"] = median_ms(forward, repeat, warmup=1), median_ms(both, repeat, warmup=0)
        rows.append(row)
    for row in rows[1:]:
        if "fwd_bwd_ms" in row:
            row["vs_dense"] = rows[0]["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return rows


def _markdown(meta: dict, rows: list[dict]) -> str:
    return markdown_table("GLM-5's sparse attention against dense attention, one layer, forward + backward", meta, [
        ("tokens", lambda r: str(r["tokens"])), ("attention", lambda r: r["attention"]),
        ("keys per query", number("keys_per_query", ".0f")), ("fwd ms", number("fwd_ms", ".1f")),
        ("fwd+bwd ms", number("fwd_bwd_ms", ".1f")), ("speed vs dense", number("vs_dense", ".2f")),
        ("peak GiB", number("peak_gib", ".2f")), ("out diff", number("out_diff", ".1e"))], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/sparse_attention")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="GLM-5's kinds of heads, few and small, on the CPU")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = GLM_5 if not args.smoke else dict(hidden=64, heads=4, qk=24, v=16, q_rank=32, rope=8, index_heads=2,
                                              index_dim=16, topk=32)
    lengths = [int(n) for n in args.lengths.split(",")] if not args.smoke else [32, 96]
    meta = {"machine": f"1 x {torch.cuda.get_device_name()}" if device == "cuda" else "CPU (smoke shape)",
            "versions": f"torch {torch.__version__}"}
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    for n in lengths:  # written after each length: a run stopped at its time limit keeps the lengths it finished
        rows += _case(shape, n, args.repeat, device)
        with open(os.path.join(args.out, "sparse_attention.json"), "w") as f:
            json.dump({**meta, "shape": shape, "rows": rows}, f, indent=1)
        text = _markdown(meta, rows)
        with open(os.path.join(args.out, "sparse_attention.md"), "w") as f:
            f.write(text)
        print(text, flush=True)


if __name__ == "__main__":
    main()
