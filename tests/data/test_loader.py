"""The plan and the iterator: coverage per epoch, determinism, resume, DP sharding, tails, stats."""

from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch

from llamafactory_mca.data import IGNORE_INDEX, BatchingConfig, DataPlan, MicroBatch, format_stats
from tests.data.fixtures import pair_row, sft_row


def sft_dataset(n_rows: int = 60, seed: int = 0, max_len: int = 40) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_list([sft_row(i, int(rng.integers(3, max_len))) for i in range(n_rows)])


def rows_of(batch: MicroBatch) -> list[int]:
    """The rows a micro-batch holds, read back from its tokens (row i's tokens are 1000 i + j)."""
    if batch.packed:
        starts = batch.cu_seqlens[:-1].long()
        return (batch.tokens[0, starts] // 1000).tolist()
    return (batch.tokens[:, 0] // 1000).tolist()


def same(a: MicroBatch, b: MicroBatch) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("tokens", "labels", "loss_mask", "position_ids"))


CONFIGS = {
    "packed": {"packing": True, "pad_multiple": 4, "pack_window": 16},
    "padded": {"packing": False, "pad_multiple": 2},
    "packed_fixed": {"packing": True, "pad_multiple": 2, "variable_seq_lengths": False},
    "padded_fixed": {"packing": False, "variable_seq_lengths": False},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_row_once_per_epoch(name):
    plan = DataPlan(sft_dataset(), BatchingConfig(cutoff_len=32, micro_batch_size=2, seed=1, **CONFIGS[name]))
    for epoch in range(2):
        seen = [row for group in plan.epoch_groups(epoch) for row in group]
        assert sorted(seen) == list(range(60))
    stream = list(plan.iterator(epochs=1))
    assert len(stream) == plan.num_micro_batches
    assert sorted(row for batch in stream for row in rows_of(batch)) == list(range(60))
    for batch in stream:
        assert batch.num_tokens <= (plan.capacity if plan.config.packing else 2 * 32)
        if not plan.config.variable_seq_lengths:
            assert batch.tokens.shape[1] == (plan.capacity if plan.config.packing else 32)


def test_shuffle_is_deterministic_per_seed_and_differs_per_epoch():
    config = BatchingConfig(cutoff_len=32, micro_batch_size=2, packing=True, seed=5)
    a, b = DataPlan(sft_dataset(), config), DataPlan(sft_dataset(), config)
    assert a.epoch_groups(0) == b.epoch_groups(0) and a.epoch_groups(3) == b.epoch_groups(3)
    assert a.epoch_groups(0) != a.epoch_groups(1)
    other = DataPlan(sft_dataset(), BatchingConfig(cutoff_len=32, micro_batch_size=2, packing=True, seed=6))
    assert other.epoch_groups(0) != a.epoch_groups(0)
    # packs are built once, so every epoch has the same count: the trainer's steps per epoch stay exact
    assert {len(a.epoch_groups(e)) for e in range(4)} == {a.num_micro_batches}


def test_eval_plan_keeps_dataset_order():
    plan = DataPlan(sft_dataset(), BatchingConfig(cutoff_len=64, micro_batch_size=4, shuffle=False))
    assert plan.epoch_groups(0) == plan.epoch_groups(1) == [tuple(range(i, min(i + 4, 60))) for i in range(0, 60, 4)]


@pytest.mark.parametrize("packing", [True, False])
def test_resume_continues_the_uninterrupted_stream(packing):
    plan = DataPlan(sft_dataset(), BatchingConfig(cutoff_len=32, micro_batch_size=2, packing=packing, seed=2))
    full = list(plan.iterator(epochs=3))
    per_epoch = plan.num_micro_batches
    for consumed in (0, 7, per_epoch - 1, per_epoch + 3):
        resumed = list(DataPlan(sft_dataset(), plan.config, log=False).iterator(consumed=consumed, epochs=3))
        assert len(resumed) == len(full) - consumed
        assert all(same(x, y) for x, y in zip(resumed, full[consumed:]))


@pytest.mark.parametrize("packing", [True, False])
def test_dp2_ranks_interleave_into_the_dp1_stream(packing):
    plan = DataPlan(sft_dataset(), BatchingConfig(cutoff_len=32, micro_batch_size=2, packing=packing, seed=4))
    multiple = 4  # dp 2 x grad_accum 2; the tail is cut the same way for both
    single = list(plan.iterator(0, 1, multiple_of=multiple, tail="drop", epochs=2))
    rank0 = list(plan.iterator(0, 2, multiple_of=multiple, tail="drop", epochs=2))
    rank1 = list(plan.iterator(1, 2, multiple_of=multiple, tail="drop", epochs=2))
    assert len(rank0) == len(rank1) == len(single) // 2
    assert all(same(x, y) for x, y in zip(single[0::2], rank0))
    assert all(same(x, y) for x, y in zip(single[1::2], rank1))
    # resuming onto dp 2 after 6 micro-batches consumed at dp 1 continues that same stream
    resumed = list(plan.iterator(1, 2, consumed=6, multiple_of=multiple, tail="drop", epochs=2))
    assert all(same(x, y) for x, y in zip(single[7::2], resumed))


def test_tail_drop_and_pad():
    plan = DataPlan(sft_dataset(n_rows=21), BatchingConfig(cutoff_len=64, micro_batch_size=2))  # 11 micro-batches
    assert plan.num_micro_batches == 11
    assert plan.micro_batches_per_epoch(4, "drop") == 8 and plan.steps_per_epoch(dp_size=2, grad_accum=2) == 2
    assert plan.micro_batches_per_epoch(4, "pad") == 12 and plan.micro_batches_per_epoch(4) == 11
    padded = list(plan.iterator(multiple_of=4, tail="pad", epochs=1))
    assert [b.is_padding for b in padded] == [False] * 11 + [True]
    assert padded[-1].num_loss_tokens == 0 and padded[-1].labels.eq(IGNORE_INDEX).all()
    it = plan.iterator(1, 2, multiple_of=4, tail="drop", epochs=2)
    assert len(it) == 8 and len(list(it)) == 8
    with pytest.raises(ValueError, match="fewer than one step"):
        plan.iterator(multiple_of=16, tail="drop")
    with pytest.raises(ValueError, match="tail"):
        plan.micro_batches_per_epoch(4, "ragged")


def test_stats_count_dropped_and_truncated_rows(caplog):
    rows = [sft_row(i, 10) for i in range(5)]
    rows[1] = {"input_ids": [], "attention_mask": [], "labels": []}  # empty
    rows[2] = sft_row(2, 1)  # one token: no position after the shift
    rows[3] = sft_row(3, 6, prompt=6)  # prompt only: no loss token
    rows[4] = sft_row(4, 50)  # longer than cutoff_len + 1: truncated to 17 tokens
    config = BatchingConfig(cutoff_len=16, micro_batch_size=1, packing=True, pad_multiple=4)
    with caplog.at_level("INFO", logger="llamafactory_mca.data.loader"):
        plan = DataPlan(datasets.Dataset.from_list(rows), config)
    stats = plan.stats
    assert (stats["rows"], stats["rows_kept"]) == (5, 2)
    assert (stats["rows_dropped_empty"], stats["rows_dropped_no_loss"]) == (2, 1)
    assert stats["rows_truncated"] == 1
    assert stats["tokens"] == 9 + 16 and stats["loss_tokens"] == 8 + 15
    assert stats["padded_tokens"] == 12 + 16 and stats["packing_efficiency"] == pytest.approx(25 / 28)
    assert stats["micro_batches"] == 2 and format_stats(stats) in caplog.text
    batch = next(b for b in plan.iterator(epochs=1) if rows_of(b) == [4])
    assert batch.tokens[0].tolist() == [4000 + j for j in range(16)]
    assert batch.labels[0].tolist() == [IGNORE_INDEX] + [4000 + j for j in range(2, 17)]


def test_pairwise_plan_keeps_pairs_and_drops_incomplete_ones():
    rows = [pair_row(i, 5 + i % 4, 4 + i % 3, ref=True) for i in range(12)]
    rows[5]["rejected_labels"] = [IGNORE_INDEX] * len(rows[5]["rejected_labels"])  # a side without loss: drop the pair
    dataset = datasets.Dataset.from_list(rows)
    packed = DataPlan(dataset, BatchingConfig(cutoff_len=16, micro_batch_size=2, packing=True, pad_multiple=2))
    assert packed.kind == "pairwise" and packed.stats["rows_dropped_no_loss"] == 1 and packed.capacity == 64
    pairs = []
    for batch in packed.iterator(epochs=1):
        owners = rows_of(batch)
        assert batch.num_pairs * 2 == len(owners) and batch.num_tokens <= 64
        assert owners[1::2] == [o + 500 for o in owners[0::2]]  # chosen then rejected, adjacent
        assert batch.ref_chosen_logps.tolist() == [-float(o) for o in owners[0::2]]
        pairs += owners[0::2]
    assert sorted(pairs) == [i for i in range(12) if i != 5]

    padded = DataPlan(dataset, BatchingConfig(cutoff_len=16, micro_batch_size=3, packing=False))
    batch = padded.micro_batch(0, 0)
    owners = rows_of(batch)
    assert batch.num_pairs == 3 and owners[3:] == [o + 500 for o in owners[:3]]


def test_pretraining_plan_has_no_labels_column():
    dataset = datasets.Dataset.from_list([{"input_ids": [7, 8, 9], "attention_mask": [1] * 3}] * 3)
    plan = DataPlan(dataset, BatchingConfig(cutoff_len=8, micro_batch_size=2, packing=True))
    assert plan.kind == "pt" and plan.stats["loss_tokens"] == 6
    batch = plan.micro_batch(0, 0)
    assert batch.labels[0, :2].tolist() == [8, 9] and batch.cu_seqlens.tolist() == [0, 2, 4, 6]


def test_config_from_training_arguments():
    args = SimpleNamespace(per_device_train_batch_size=2, per_device_eval_batch_size=5, seed=7, data_seed=None,
                           allow_variable_seq_lengths=lambda: False)
    train = BatchingConfig.from_args(args, cutoff_len=100, packing=True, pad_multiple=4, pad_token_id=3)
    assert (train.micro_batch_size, train.seed, train.shuffle, train.variable_seq_lengths) == (2, 7, True, False)
    assert train.capacity() == 200 and train.capacity(2) == 400 and train.fixed_length == 104
    evaluation = BatchingConfig.from_args(args, cutoff_len=100, packing=False, pad_multiple=1, pad_token_id=3,
                                          for_eval=True)
    assert evaluation.micro_batch_size == 5 and not evaluation.shuffle
    with pytest.raises(ValueError, match="cutoff_len"):
        BatchingConfig(cutoff_len=0)


def test_streaming_datasets_are_refused():
    stream = datasets.Dataset.from_list([sft_row(0, 5)]).to_iterable_dataset()
    with pytest.raises(TypeError, match="streaming"):
        DataPlan(stream, BatchingConfig(cutoff_len=8))
