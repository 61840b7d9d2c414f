"""Where a training step of our path spends its time: torch profiler over full optimizer steps.

    python benchmarks/profile_step.py --out DIR            # Qwen3-1.7B shape, 8 packed 4096-token micro-batches
    python benchmarks/profile_step.py --moe --layers 8 --out DIR   # Qwen3-30B-A3B shape
    python benchmarks/profile_step.py --next --layers 3 --out DIR  # Qwen3-Next-80B-A3B shape
    python benchmarks/profile_step.py --gemma4-e2b --layers 35 --tokens 8192 --micro 4 --out DIR  # Gemma 4 E2B
    python benchmarks/profile_step.py --baseline --out DIR # megatron-core's own fallbacks instead of ours (below)
    python benchmarks/profile_step.py --smoke --out DIR    # tiny shape, CPU
    python benchmarks/profile_step.py --megatron-step --out DIR  # Megatron's optimizer step (gradients scaled apart)
    torchrun --nproc-per-node 2 benchmarks/profile_step.py --tp 2 --out DIR  # TP2 + SP; --pp 2; --moe --ep 2

Random weights, one GPU (or a TP / PP / EP layout under torchrun, a report per rank), bf16, the native layer spec,
Megatron DDP + distributed optimizer, the same forward step and loss as McaTrainer. Writes
``profile_<shape>_<variant>.md``: step time, GPU busy share, MFU, kernel launches and host synchronisations per step,
top kernels and top CPU ops. ``--baseline`` runs the step on megatron-core's own paths instead of our replacements:
its THD RoPE and apex-less grad norm, its MoE dispatcher (moe_local_dispatch: false), SwiGLU unfused
(bias_activation_fusion: false), Megatron's fp32 cross-entropy (native_cross_entropy: false).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch
from _profile_counts import step_counts


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per packed micro-batch")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B shape (128 experts, top 8)")
    parser.add_argument("--next", action="store_true", help="Qwen3-Next-80B-A3B shape (512 experts, top 10; gated "
                                                           "delta-rule layers, every 3rd full attention)")
    parser.add_argument("--gemma4-e2b", action="store_true", help="Gemma 4 E2B shape (per-layer inputs, the last 20 "
                                                                  "of 35 layers sharing keys and values)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (with sequence parallel)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (with --moe or --next)")
    parser.add_argument("--baseline", action="store_true", help="megatron-core's fallbacks instead of ours")
    parser.add_argument("--megatron-step", action="store_true", help="Megatron's optimizer step instead of ours "
                        "(OptimizerStep): the token division and the clipping as passes over the gradients")
    parser.add_argument("--off", default="", help="comma-separated recipe keys of ours set to false (one change "
                                                  "left out at a time: native_cross_entropy, ...)")
    parser.add_argument("--on", default="", help="comma-separated recipe keys set to true (gradient_accumulation_"
                                                 "fusion, cuda_graphs: off by default)")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29671")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from transformers import Gemma4TextConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig

    from llamafactory_mca import parallel
    from llamafactory_mca.data import MicroBatch
    from llamafactory_mca.models.auto import AutoModel
    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.trainer.loss import lm_loss
    from llamafactory_mca.trainer.optim import OptimizerStep, build_optimizer, wrap_ddp
    from llamafactory_mca.training_args import TrainingArguments

    shape = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=args.layers, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    if args.moe:
        shape.update(intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False)
    if args.next:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from e2e_workloads import QWEN3_NEXT_80B

        shape = {k: v for k, v in QWEN3_NEXT_80B.items() if k != "model_type"}
        shape.update(num_hidden_layers=args.layers, layer_types=[
            "full_attention" if (i + 1) % 3 == 0 else "linear_attention" for i in range(args.layers)])
    if args.gemma4_e2b:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from e2e_workloads import model_config

        shape = {k: v for k, v in model_config("gemma4_e2b", args.layers, args.smoke).items() if k != "model_type"}
    tokens, seqs, micro = args.tokens, 4, args.micro
    if args.smoke and not args.gemma4_e2b:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512,
                     **(dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2) if args.moe else {}),
                     **(dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             shared_expert_intermediate_size=32) if args.next else {}))
        if args.next:
            shape.update(num_hidden_layers=3, layer_types=shape["layer_types"][:3])
        tokens, micro = 256, 2
    gpu = torch.cuda.is_available()
    variant = dict(moe_local_dispatch=False, bias_activation_fusion=False, native_cross_entropy=False
                   ) if args.baseline else {}
    off, on = [k for k in args.off.split(",") if k], [k for k in args.on.split(",") if k]
    variant.update({k: False for k in off} | {k: True for k in on})
    targs = TrainingArguments(output_dir=args.out, bf16=gpu, use_distributed_optimizer=True, overlap_grad_reduce=True,
                              learning_rate=1e-5, report_to="none", moe_grouped_gemm=(args.moe or args.next) or None,
                              tensor_model_parallel_size=args.tp, sequence_parallel=args.tp > 1,
                              pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep, **variant)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel.initialize(targs.resolve_layout(world_size=world), cuda_graphs=targs.run_cuda_graphs())
    family, hf = (("qwen3_next", Qwen3NextConfig(**shape)) if args.next else ("qwen3_moe", Qwen3MoeConfig(**shape))
                  if args.moe else ("gemma4_text", Gemma4TextConfig(**shape)) if args.gemma4_e2b
                  else ("qwen3", Qwen3Config(**shape)))
    config = get_family(family).config_from_hf(hf)
    model = AutoModel.from_config(config, targs)
    if args.baseline:  # after the build, which installs ours
        _megatron_fallbacks()
    wrapped = wrap_ddp(model.chunks, model.transformer_config, targs)
    optimizer = build_optimizer(wrapped, model.transformer_config, targs)
    step_optimizer = optimizer.step if args.megatron_step else \
        OptimizerStep(optimizer, wrapped, model.transformer_config).step  # as McaTrainer steps
    device = torch.device("cuda") if gpu else torch.device("cpu")
    length = tokens // seqs
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)

    def batch() -> MicroBatch:
        ids = torch.randint(0, shape["vocab_size"], (1, tokens), generator=g)
        b = MicroBatch(tokens=ids, labels=ids.roll(-1, 1), loss_mask=torch.ones(1, tokens),
                       position_ids=torch.arange(length).repeat(seqs).view(1, -1),
                       seq_ids=torch.arange(seqs).repeat_interleave(length).view(1, -1), cu_seqlens=cu,
                       max_seqlen=length, seqlens=[length] * seqs, num_tokens=tokens, num_real_tokens=tokens,
                       num_loss_tokens=tokens, num_data_tokens=tokens)
        return (b.with_slots(seqs) if targs.cuda_graphs else b).to(device)  # as the trainer's feeder shapes them

    batches = [batch() for _ in range(micro)]

    def forward_step(iterator, chunk):  # every stage gets the whole micro-batch, as McaTrainer's does
        b = next(iterator)
        out = chunk(b.tokens, b.position_ids, None, labels=b.model_labels, packed_seq_params=b.packed_seq_params())
        return out, partial(lm_loss, b.loss_mask)

    def step() -> None:
        for w in wrapped:
            w.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=wrapped[0],
                                    num_microbatches=micro, seq_length=tokens, micro_batch_size=1)
        step_optimizer()

    for _ in range(2):
        step()
    if gpu:
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if gpu:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    counts = step_counts(events, args.steps, seconds * args.steps, gpu)
    sort = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    from llamafactory_mca.models.cost import flops_per_sequence_set, peak_flops

    flops = flops_per_sequence_set(config.transformer, config.vocab_size, [length] * seqs * micro)
    peak = peak_flops()
    sharing = args.tp * args.pp  # GPUs that share one micro-batch; under EP the others are data parallel
    kind = "next" if args.next else "moe" if args.moe else "gemma4_e2b" if args.gemma4_e2b else "dense"
    name = f"{kind}_{'baseline' if args.baseline else 'ours'}"
    name += "".join(f"_{k}{n}" for k, n in (("tp", args.tp), ("pp", args.pp), ("ep", args.ep)) if n > 1)
    name += f"_rank{rank}" if world > 1 else ""
    name += "".join(f"_no_{k}" for k in off) + "".join(f"_with_{k}" for k in on)
    name += "_megatron_step" if args.megatron_step else ""
    lines = [f"# One optimizer step of our path, {name} ({'GPU ' + torch.cuda.get_device_name() if gpu else 'CPU'})",
             "", f"{type(hf).__name__} {shape}, {micro} packed micro-batches of {tokens} tokens ({seqs} sequences "
             f"each), bf16; torch {torch.__version__}"
             + ("; megatron-core's fallbacks (--baseline)" if args.baseline else "")
             + "".join(f"; {k}: false" for k in off) + "".join(f"; {k}: true" for k in on)
             + ("; Megatron's optimizer step (--megatron-step)" if args.megatron_step else ""),
             "", f"- step time {seconds * 1e3:.1f} ms; {micro * tokens / seconds / sharing:,.0f} tokens/s/GPU",
             f"- GPU kernel time {counts['kernel_ms_per_step']:.1f} ms per step = {counts['gpu_busy']:.0%} of the step"
             if gpu else "- (CPU run)",
             f"- MFU {flops / seconds / peak / sharing:.1%}" if peak else "",
             f"- per step: {counts['launches_per_step']:,.0f} kernel launches, {counts['syncs_per_step']:,.0f} host "
             f"synchronisations (stream/device/event), {counts['memcpy_per_step']:,.0f} cudaMemcpyAsync (each from or "
             "to pageable host memory waits for the stream)" if gpu else "",
             "", "## Top operations by self device time", "",
             "```", events.table(sort_by=sort, row_limit=25, max_name_column_width=70), "```", "",
             "## Top operations by self CPU time", "", "```",
             events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70), "```"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{name}_{tokens}x{micro}.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[:9]))
    parallel.destroy()


def _megatron_fallbacks() -> None:
    """Undo the speed replacements of compat.apply_megatron_fixes and models.native.install (correctness fixes
    stay)."""
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads

    from llamafactory_mca.models.native.rope import MEGATRON_THD_ROPE

    rope_utils._apply_rotary_pos_emb_thd = MEGATRON_THD_ROPE
    clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = utils.local_multi_tensor_scale


if __name__ == "__main__":
    main()
