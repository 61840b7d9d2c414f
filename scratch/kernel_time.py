"""Triton kernels vs the torch.compile'd functions they replace, at a MoE step's shapes (one H200)."""
import time, torch, json, sys
from megatron.core.fusions import fused_bias_swiglu as fbs
from llamafactory_mca.models.native import swiglu_triton, loss_triton, combine_triton, cross_entropy

def bench(fn, n=20):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

res = {}
dev = "cuda"
for name, rows, width, weighted in (("moe_fc1_act", 32768, 768, True), ("dense_act", 4096, 6144, False)):
    x = torch.randn(rows, 2 * width, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(rows, 1, device=dev, requires_grad=True) if weighted else None
    g = torch.randn(rows, width, device=dev, dtype=torch.bfloat16)
    if weighted:
        tri = lambda: swiglu_triton.swiglu(x, w).backward(g)
        meg = lambda: fbs.weighted_bias_swiglu_impl(x, None, w).backward(g)
    else:
        tri = lambda: swiglu_triton.swiglu(x).backward(g)
        meg = lambda: fbs.bias_swiglu_impl(x, None).backward(g)
    t0 = time.perf_counter(); meg(); torch.cuda.synchronize(); first = time.perf_counter() - t0
    res[name] = {"triton_ms": bench(tri), "compiled_ms": bench(meg), "compiled_first_s": first}
    yt = swiglu_triton.swiglu(x, w) if weighted else swiglu_triton.swiglu(x)
    ym = fbs.weighted_bias_swiglu_impl(x, None, w) if weighted else fbs.bias_swiglu_impl(x, None)
    res[name]["max_diff"] = (yt.float() - ym.float()).abs().max().item()

logits = torch.randn(4096, 151936, device=dev, dtype=torch.bfloat16) * 3
target = torch.randint(0, 151936, (4096,), device=dev)
comp_stats = torch.compile(cross_entropy._row_stats, fullgraph=True)
comp_grad = torch.compile(cross_entropy._grad, fullgraph=True)
m, s = loss_triton.row_stats(logits); lse = m + s.log(); gl = torch.rand(4096, device=dev)
res["ce_stats"] = {"triton_ms": bench(lambda: loss_triton.row_stats(logits)), "compiled_ms": bench(lambda: comp_stats(logits))}
res["ce_grad"] = {"triton_ms": bench(lambda: loss_triton.grad(logits, lse, gl, target)),
                  "compiled_ms": bench(lambda: comp_grad(logits, lse, gl, target))}
cm, cs = comp_stats(logits)
res["ce_stats"]["max_diff"] = max((m - cm).abs().max().item(), ((s - cs).abs() / cs).max().item())
rows = torch.randn(32768, 2048, device=dev, dtype=torch.bfloat16); idx = torch.randperm(32768, device=dev)
comp_sum = torch.compile(lambda r, i: r.index_select(0, i).view(-1, 8, r.size(-1)).sum(1), fullgraph=True)
res["combine"] = {"triton_ms": bench(lambda: combine_triton.gather_sum(rows, idx, 8)),
                  "compiled_ms": bench(lambda: comp_sum(rows, idx))}
json.dump(res, open(sys.argv[1], "w"), indent=1)
for k, v in res.items(): print(k, {a: round(b, 4) for a, b in v.items()})
