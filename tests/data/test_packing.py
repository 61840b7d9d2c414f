"""Packing and collation: capacity, windows, the in-sequence shift, THD boundaries, padding rules, DPO pairs."""

import itertools
import math

import numpy as np
import pytest
import torch

from llamafactory_mca.data import IGNORE_INDEX, BatchingConfig, DataPlan, collate_packed, collate_padded
from llamafactory_mca.data.packing import pack_window_ffd
from llamafactory_mca.data.rows import PAIRWISE, PT, SFT, make_sample
from tests.data.fixtures import pair_row, sft_row, tokenized_dataset


def test_ffd_respects_capacity_windows_and_order():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 50, size=300)
    order = rng.permutation(300)
    packs = pack_window_ffd(sizes, order, capacity=64, window=16)
    position = {int(index): p for p, index in enumerate(order)}
    assert sorted(i for pack in packs for i in pack) == list(range(300))  # each index exactly once
    for pack in packs:
        assert sum(sizes[list(pack)]) <= 64
        assert len({position[i] // 16 for i in pack}) == 1  # never spans two windows
        assert [position[i] for i in pack] == sorted(position[i] for i in pack)  # members keep their order
    firsts = [position[pack[0]] for pack in packs]
    assert firsts == sorted(firsts)
    # first-fit-decreasing fills well: at most one pack per window beyond the lower bound
    lower = sum(math.ceil(sizes[order[s : s + 16]].sum() / 64) for s in range(0, 300, 16))
    assert len(packs) <= lower + math.ceil(300 / 16)


def test_ffd_refuses_an_item_over_capacity():
    with pytest.raises(ValueError, match="capacity"):
        pack_window_ffd(np.array([10, 70]), [0, 1], capacity=64, window=8)


def test_packed_collation_shifts_inside_each_sequence():
    rows = [sft_row(1, 7), sft_row(2, 12, prompt=5), sft_row(3, 3)]
    samples = [make_sample(row, SFT, cutoff_len=16) for row in rows]
    batch = collate_packed(samples, pad_multiple=4, pad_token_id=0)

    real = [6, 11, 2]  # n - 1 positions each
    padded = [8, 12, 4]
    assert batch.tokens.shape == (1, sum(padded))
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 8, 20, 24]
    assert batch.max_seqlen == 12
    assert batch.num_tokens == 24 and batch.num_real_tokens == sum(real)
    for row, start, n, width in zip(rows, batch.cu_seqlens.tolist(), real, padded):
        ids, labels = row["input_ids"], row["labels"]
        assert batch.tokens[0, start : start + n].tolist() == ids[:-1]
        assert batch.labels[0, start : start + n].tolist() == labels[1:]  # the target never comes from a neighbour
        assert batch.position_ids[0, start : start + width].tolist() == list(range(width))
        assert batch.labels[0, start + n : start + width].eq(IGNORE_INDEX).all()
        assert batch.loss_mask[0, start + n : start + width].eq(0).all()
        assert batch.tokens[0, start + n : start + width].eq(0).all()
    assert batch.loss_mask.sum().item() == batch.num_loss_tokens == 5 + 7 + 1
    assert torch.equal(batch.loss_mask.bool(), batch.labels.ne(IGNORE_INDEX))

    params = batch.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 12
    assert params.cu_seqlens_q is params.cu_seqlens_kv_padded is batch.cu_seqlens


def test_packed_collation_fixed_length_pads_the_last_sequence():
    samples = [make_sample(sft_row(i, 5), SFT, cutoff_len=16) for i in range(2)]
    batch = collate_packed(samples, pad_multiple=2, pad_token_id=7, total_length=32)
    assert batch.tokens.shape == (1, 32)
    assert batch.cu_seqlens.tolist() == [0, 4, 32]
    assert batch.position_ids[0, 4:].tolist() == list(range(28))
    assert batch.tokens[0, 8:].eq(7).all() and batch.num_real_tokens == 8
    with pytest.raises(ValueError, match="fixed length"):
        collate_packed(samples, pad_multiple=2, pad_token_id=0, total_length=6)


def test_packed_collation_rounds_the_pack_to_a_tile_within_its_capacity():
    samples = [make_sample(sft_row(i, 41), SFT, cutoff_len=128) for i in range(3)]  # 40 positions each
    batch = collate_packed(samples, pad_multiple=4, pad_token_id=0, capacity=256)
    assert batch.cu_seqlens.tolist() == [0, 40, 80, 128] and batch.num_real_tokens == 120  # 120 -> 128
    assert batch.loss_mask[0, 120:].eq(0).all() and batch.position_ids[0, 80:].tolist() == list(range(48))
    capped = collate_packed(samples, pad_multiple=4, pad_token_id=0, capacity=124)
    assert capped.cu_seqlens.tolist() == [0, 40, 80, 124]  # never past the pack's capacity


def test_padded_collation_pads_to_the_longest_row_rounded():
    samples = [make_sample(sft_row(i, n), SFT, cutoff_len=100) for i, n in enumerate([5, 14, 9])]
    batch = collate_padded(samples, pad_multiple=4, pad_token_id=0)  # lcm(4, 8) = 8; longest 13 -> 16
    assert batch.tokens.shape == (3, 16) and batch.cu_seqlens is None and batch.packed_seq_params() is None
    assert batch.num_tokens == 48 and batch.num_real_tokens == 4 + 13 + 8
    assert batch.position_ids[2].tolist() == list(range(16))
    assert batch.tokens[1, :13].tolist() == [1000 + j for j in range(13)]
    assert batch.labels[0, 4:].eq(IGNORE_INDEX).all()
    assert collate_padded(samples, pad_multiple=6, pad_token_id=0).tokens.shape == (3, 24)  # lcm(6, 8)

    fixed = collate_padded(samples, pad_multiple=4, pad_token_id=0, fixed_length=104)
    assert fixed.tokens.shape == (3, 104)
    assert torch.equal(fixed.labels[:, :16], batch.labels)


def test_pretraining_targets_are_the_next_tokens():
    sample = make_sample({"input_ids": [5, 6, 7, 8], "attention_mask": [1] * 4}, PT, cutoff_len=8)
    batch = collate_packed([sample], pad_multiple=1, pad_token_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7]] and batch.labels.tolist() == [[6, 7, 8]]
    assert batch.num_loss_tokens == 3


def test_dpo_pairs_stay_adjacent_when_packed_and_split_when_padded():
    rows = [pair_row(1, 6, 9), pair_row(2, 4, 3)]
    samples = [make_sample(row, PAIRWISE, cutoff_len=16) for row in rows]
    for i, sample in zip((1, 2), samples):
        sample.ref_logps = (-float(i), -float(i) - 0.5)

    packed = collate_packed(samples, pad_multiple=2, pad_token_id=0, pairwise=True)
    assert packed.num_pairs == 2 and packed.num_sequences == 4
    bounds = packed.cu_seqlens.tolist()
    first_tokens = [packed.tokens[0, start].item() // 1000 for start in bounds[:-1]]
    assert first_tokens == [1, 501, 2, 502]  # sequence 2i chosen, 2i + 1 rejected of pair i
    assert packed.ref_chosen_logps.tolist() == [-1.0, -2.0]
    assert packed.ref_rejected_logps.tolist() == [-1.5, -2.5]

    padded = collate_padded(samples, pad_multiple=1, pad_token_id=0, pairwise=True)
    assert padded.tokens.shape == (4, 8) and padded.num_pairs == 2
    assert (padded.tokens[:, 0] // 1000).tolist() == [1, 2, 501, 502]  # rows [0, n) chosen, [n, 2n) rejected

    plain = [make_sample(pair_row(i, 4, 4), PAIRWISE, cutoff_len=16) for i in range(2)]
    assert collate_packed(plain, 1, 0, pairwise=True).ref_chosen_logps is None


def test_micro_batch_to_moves_every_tensor():
    batch = collate_packed([make_sample(sft_row(0, 5), SFT, 8)], 1, 0)
    moved = batch.to("cpu")
    assert moved is not batch and torch.equal(moved.tokens, batch.tokens)
    assert moved.cu_seqlens.device.type == "cpu" and moved.num_tokens == batch.num_tokens
    masked = batch.without_loss()
    assert masked.is_padding and masked.num_loss_tokens == 0 and masked.loss_mask.sum() == 0
    assert torch.equal(masked.tokens, batch.tokens)
    # the positions whose target counts, found on the host, sequence-major ([s, b] flattened: p * b + row); a
    # micro-batch without any computes position 0 (its mask zeroes the loss)
    padded = collate_padded([make_sample(sft_row(i, 3 + 2 * i), SFT, 8) for i in range(2)], 1, 0)
    mask = padded.loss_mask
    expected = [p * 2 + r for p in range(mask.shape[1]) for r in range(2) if mask[r, p] > 0]
    assert padded.to("cpu").loss_rows.tolist() == expected and len(expected) == padded.num_loss_tokens
    assert moved.loss_rows.tolist() == batch.loss_mask[0].nonzero().squeeze(1).tolist()
    assert masked.to("cpu").loss_rows.tolist() == [0]


def test_padded_to_a_step_length_then_cut_for_context_parallel_ranks():
    from llamafactory_mca.data.context_parallel import for_context_parallel_rank

    pair = [make_sample(pair_row(i, 5, 3), PAIRWISE, 8) for i in range(2)]
    for batch in (collate_packed(pair, 4, 0, pairwise=True), collate_padded(pair, 4, 0, pairwise=True)):
        longer = batch.padded_to(batch.tokens.shape[1] + 4)
        assert longer.num_loss_tokens == batch.num_loss_tokens and longer.loss_mask.sum() == batch.loss_mask.sum()
        assert (longer.labels[:, -4:] == IGNORE_INDEX).all() and (longer.model_labels >= 0).all()
        assert longer.seqlens[-1] == batch.seqlens[-1] + 4 and longer.seq_ids.shape == longer.tokens.shape
        if batch.packed:
            assert longer.cu_seqlens[-1] == batch.cu_seqlens[-1] + 4 and longer.seq_ids[0, -1] == 3
            assert longer.seq_ids[0].unique().tolist() == [0, 1, 2, 3]  # pair i: 2i chosen, 2i + 1 rejected
        else:
            assert longer.seq_ids[:, 0].tolist() == [0, 2, 1, 3]  # rows: chosen of both pairs, then rejected
        halves = [for_context_parallel_rank(longer, rank, 2) for rank in range(2)]
        for name in ("tokens", "labels", "loss_mask", "position_ids", "seq_ids"):
            assert sum(getattr(h, name).numel() for h in halves) == getattr(longer, name).numel()
        assert sum(h.loss_mask.sum() for h in halves) == longer.loss_mask.sum()
        assert halves[0].seqlens == longer.seqlens and halves[0].cu_seqlens is longer.cu_seqlens  # stay global
    assert for_context_parallel_rank(batch, 0, 1) is batch


def test_rows_from_llamafactory_processing_pack_correctly(tmp_path):
    dataset, tokenizer = tokenized_dataset(str(tmp_path), n_rows=6, cutoff_len=64, template="qwen3_nothink")
    assert len(dataset) == 6 and "labels" in dataset.column_names
    config = BatchingConfig(cutoff_len=64, micro_batch_size=2, packing=True, pad_multiple=4,
                            pad_token_id=tokenizer.pad_token_id, seed=3)
    plan = DataPlan(dataset, config)
    assert plan.kind == SFT and plan.stats["rows_kept"] == 6 and plan.stats["rows_truncated"] == 0

    seen = []
    for group in plan.epoch_groups(0):
        batch = plan.collate(group)
        assert batch.num_tokens <= plan.capacity == 128
        bounds = batch.cu_seqlens.tolist()
        assert all((end - start) % 4 == 0 for start, end in itertools.pairwise(bounds))
        for index, start in zip(group, bounds):
            ids, labels = dataset[index]["input_ids"], dataset[index]["labels"]
            n = len(ids) - 1
            assert batch.tokens[0, start : start + n].tolist() == ids[:-1]
            assert batch.labels[0, start : start + n].tolist() == labels[1:]
            assert labels[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # the answer's end is learned
            seen.append(index)
    assert sorted(seen) == list(range(6))


def test_pairwise_rows_from_llamafactory_processing_pack_as_pairs(tmp_path):
    dataset, tokenizer = tokenized_dataset(str(tmp_path), n_rows=5, cutoff_len=48, stage="rm")
    assert {"chosen_input_ids", "rejected_labels"} <= set(dataset.column_names)
    plan = DataPlan(dataset, BatchingConfig(cutoff_len=48, micro_batch_size=2, packing=True, pad_multiple=2,
                                            pad_token_id=tokenizer.pad_token_id))
    assert plan.kind == PAIRWISE and plan.stats["rows_kept"] == 5
    pairs = 0
    for group in plan.epoch_groups(0):
        batch = plan.collate(group)
        bounds = batch.cu_seqlens.tolist()
        assert batch.num_pairs == len(group) and len(bounds) == 2 * len(group) + 1
        for k, index in enumerate(group):
            for side, start in zip(("chosen", "rejected"), bounds[2 * k : 2 * k + 2]):
                ids = dataset[index][f"{side}_input_ids"]
                assert batch.tokens[0, start : start + len(ids) - 1].tolist() == ids[:-1]
        pairs += batch.num_pairs
    assert pairs == 5
