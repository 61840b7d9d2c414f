"""Where a training step of our path spends its time: torch profiler over full optimizer steps.

    python benchmarks/profile_step.py --out DIR            # Qwen3-1.7B shape, 8 packed 4096-token micro-batches
    python benchmarks/profile_step.py --smoke --out DIR    # tiny shape, CPU

Random weights, one GPU, bf16, the native layer spec, Megatron DDP + distributed optimizer, the same forward
step and loss as McaTrainer. Writes ``profile.md`` (step time, GPU busy share, top kernels and top CPU ops).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per packed micro-batch")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29671")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from transformers import Qwen3Config

    from llamafactory_mca import parallel
    from llamafactory_mca.training_args import TrainingArguments
    from llamafactory_mca.models.auto import AutoModel
    from llamafactory_mca.models.families import get_family
    from llamafactory_mca.data import MicroBatch
    from llamafactory_mca.trainer.loss import lm_loss
    from llamafactory_mca.trainer.optim import build_optimizer, wrap_ddp

    shape = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=args.layers, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    tokens, seqs, micro = args.tokens, 4, args.micro
    if args.smoke:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=512)
        tokens, micro = 256, 2
    gpu = torch.cuda.is_available()
    targs = TrainingArguments(output_dir=args.out, bf16=gpu, use_distributed_optimizer=True, overlap_grad_reduce=True,
                              learning_rate=1e-5, report_to="none")
    parallel.initialize(targs.resolve_layout(world_size=1))
    config = get_family("qwen3").config_from_hf(Qwen3Config(**shape))
    model = AutoModel.from_config(config, targs)
    wrapped = wrap_ddp(model.chunks, model.transformer_config, targs)
    optimizer = build_optimizer(wrapped, model.transformer_config, targs)
    device = torch.device("cuda") if gpu else torch.device("cpu")
    length = tokens // seqs
    cu = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)

    def batch() -> MicroBatch:
        ids = torch.randint(0, shape["vocab_size"], (1, tokens), generator=g)
        return MicroBatch(tokens=ids, labels=ids.roll(-1, 1), loss_mask=torch.ones(1, tokens),
                          position_ids=torch.arange(length).repeat(seqs).view(1, -1),
                          seq_ids=torch.arange(seqs).repeat_interleave(length).view(1, -1), cu_seqlens=cu,
                          max_seqlen=length, seqlens=[length] * seqs, num_tokens=tokens, num_real_tokens=tokens,
                          num_loss_tokens=tokens, num_data_tokens=tokens).to(device)

    batches = [batch() for _ in range(micro)]

    def forward_step(iterator, chunk):
        b = next(iterator)
        out = chunk(b.tokens, b.position_ids, None, labels=b.model_labels, packed_seq_params=b.packed_seq_params())
        return out, partial(lm_loss, b.loss_mask)

    def step() -> None:
        for w in wrapped:
            w.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=wrapped[0],
                                    num_microbatches=micro, seq_length=tokens, micro_batch_size=1)
        optimizer.step()

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
    sort = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    kernel_us = sum(e.self_device_time_total for e in events) / args.steps if gpu else 0.0
    from llamafactory_mca.trainer.metrics import flops_per_sequence_set, peak_flops

    flops = flops_per_sequence_set(config.transformer, config.vocab_size, [length] * seqs * micro)
    peak = peak_flops()
    lines = [f"# One optimizer step of our path ({'GPU ' + torch.cuda.get_device_name() if gpu else 'CPU'})", "",
             f"Qwen3 shape {shape}, {micro} packed micro-batches of {tokens} tokens ({seqs} sequences each), bf16",
             "", f"- step time {seconds * 1e3:.1f} ms; {micro * tokens / seconds:,.0f} tokens/s",
             f"- GPU kernel time {kernel_us / 1e3:.1f} ms per step = {kernel_us / 1e6 / seconds:.0%} of the step"
             if gpu else "- (CPU run)",
             f"- MFU {flops / seconds / peak:.1%}" if peak else "", "", "## Top operations by self device time", "",
             "```", events.table(sort_by=sort, row_limit=25, max_name_column_width=70), "```", "",
             "## Top operations by self CPU time", "", "```",
             events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70), "```"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{tokens}x{micro}.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print("\n".join(lines[:8]))
    parallel.destroy()


if __name__ == "__main__":
    main()
