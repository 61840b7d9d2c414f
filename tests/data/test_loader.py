"""The plan and its steps: coverage per epoch, determinism, resume, DP sharding, epoch tails, stats."""

from dataclasses import replace
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


def stream(plan: DataPlan, **kwargs) -> list[MicroBatch]:
    """The micro-batches of ``plan.steps(**kwargs)``, in order."""
    return [batch for step in plan.steps(**kwargs) for batch in step.micro_batches]


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
    batches = stream(plan, epochs=1)
    assert len(batches) == plan.num_micro_batches
    assert sorted(row for batch in batches for row in rows_of(batch)) == list(range(60))
    for batch in batches:
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


def test_a_resume_under_another_micro_batch_says_which():
    """``merge_micro_batches`` can change a packed micro-batch's size between runs (auto decides from the GPU's
    memory): the resume's note names the sizes and the key; a checkpoint written before the size was recorded reads as
    this run's."""
    from llamafactory_mca.parallel import ParallelLayout
    from llamafactory_mca.trainer.feeder import StepFeeder

    layout = ParallelLayout(world_size=1, tp=1, pp=1, vpp=None, cp=1, ep=1, etp=1, dp=1, expert_dp=1,
                            micro_batch_size=2, grad_accum=4)

    def feeder(micro):
        return StepFeeder(DataPlan(sft_dataset(), BatchingConfig(cutoff_len=32, micro_batch_size=micro, packing=True)),
                          layout)

    recipes, merged = feeder(2), feeder(4)
    assert merged.resume_note(merged.signature) is None
    assert recipes.resume_note({k: v for k, v in recipes.signature.items() if k != "micro_batch_size"}) is None
    note = merged.resume_note(recipes.signature)
    assert f"({recipes.signature['micro_batches']} -> {merged.signature['micro_batches']} per epoch: micro-batches " \
           "of 4 rows' tokens instead of 2 (per_device_train_batch_size x merge_micro_batches" in note, note


def test_eval_plan_keeps_dataset_order():
    plan = DataPlan(sft_dataset(), BatchingConfig(cutoff_len=64, micro_batch_size=4, shuffle=False))
    assert plan.epoch_groups(0) == plan.epoch_groups(1) == [tuple(range(i, min(i + 4, 60))) for i in range(0, 60, 4)]


@pytest.mark.parametrize("packing", [True, False])
def test_resume_continues_the_uninterrupted_stream(packing):
    plan = DataPlan(sft_dataset(), BatchingConfig(cutoff_len=32, micro_batch_size=2, packing=packing, seed=2))
    full = stream(plan, epochs=3)
    per_epoch = plan.num_micro_batches
    for consumed in (0, 7, per_epoch - 1, per_epoch + 3):
        resumed = stream(DataPlan(sft_dataset(), plan.config, log=False), consumed=consumed, epochs=3)
        assert len(resumed) == len(full) - consumed
        assert all(same(x, y) for x, y in zip(resumed, full[consumed:]))


@pytest.mark.parametrize("packing", [True, False])
def test_dp2_ranks_interleave_into_the_dp1_stream(packing):
    plan = DataPlan(sft_dataset(), BatchingConfig(cutoff_len=32, micro_batch_size=2, packing=packing, seed=4))
    single = stream(plan, epochs=2)
    n = plan.num_micro_batches
    ranks = [stream(plan, dp_rank=r, dp_size=2, grad_accum=2, epochs=2) for r in (0, 1)]
    for r in (0, 1):
        real = [b for b in ranks[r] if not b.is_padding]
        expected = [b for e in range(2) for b in single[e * n + r: (e + 1) * n: 2]]
        assert len(real) == len(expected) and all(same(x, y) for x, y in zip(real, expected))
    # resuming onto dp 2 after 4 micro-batches consumed at dp 1 continues that same stream
    resumed = [b for b in stream(plan, dp_rank=1, dp_size=2, grad_accum=2, consumed=4, epochs=1)]
    assert all(same(x, y) for x, y in zip(resumed, single[5:n:2]))


def test_the_last_step_of_an_epoch_takes_what_is_left():
    plan = DataPlan(sft_dataset(n_rows=21), BatchingConfig(cutoff_len=64, micro_batch_size=2))  # 11 micro-batches
    assert plan.num_micro_batches == 11 and plan.steps_per_epoch(dp_size=2, grad_accum=2) == 3
    steps = [list(plan.steps(dp_rank=r, dp_size=2, grad_accum=2, epochs=1)) for r in (0, 1)]
    assert [s.consumed for s in steps[0]] == [4, 8, 11] and [s.epoch for s in steps[0]] == [0, 0, 0]
    assert [len(s.micro_batches) for s in steps[0]] == [2, 2, 2]  # micro-batches 8 and 10
    assert [len(s.micro_batches) for s in steps[1]] == [2, 2, 1]  # micro-batch 9: one fewer, no stand-in
    assert sum(len(rows_of(b)) for s in steps[0] + steps[1] for b in s.micro_batches) == 21  # every row, once
    # expert parallelism needs equal counts, the interleaved schedule a multiple of the pipeline size
    tail = list(plan.steps(dp_rank=1, dp_size=2, grad_accum=2, equal_counts=True, epochs=1))[-1].micro_batches
    assert [b.is_padding for b in tail] == [False, True]
    tail = list(plan.steps(dp_rank=0, dp_size=2, grad_accum=2, multiple_of=4, epochs=1))[-1].micro_batches
    assert [b.is_padding for b in tail] == [False, False, True, True]
    stand_in = tail[-1]
    assert stand_in.num_loss_tokens == 0 and stand_in.labels.eq(IGNORE_INDEX).all()
    assert stand_in.num_real_tokens == 0 and stand_in.num_data_tokens == 0
    # an epoch ending with fewer micro-batches than ranks: the rank without one runs a stand-in
    small = DataPlan(sft_dataset(n_rows=5), BatchingConfig(cutoff_len=64, micro_batch_size=2))  # 3 micro-batches
    last = list(small.steps(dp_rank=1, dp_size=2, grad_accum=1, epochs=1))
    assert [[b.is_padding for b in s.micro_batches] for s in last] == [[False], [True]]
    with pytest.raises(ValueError, match="not a whole step"):
        next(plan.steps(dp_size=2, grad_accum=2, consumed=6))
    # written at dp 3 x accumulation 2: the accumulation that keeps 6 micro-batches per step at dp 2 is named
    with pytest.raises(ValueError, match="took 6 micro-batches: gradient_accumulation_steps: 3 keeps its global"):
        next(plan.steps(dp_size=2, grad_accum=2, consumed=6, step_before=6))
    with pytest.raises(ValueError, match="which dp 4 does not divide"):
        next(plan.steps(dp_size=4, grad_accum=1, consumed=6, step_before=6))


def test_equal_rows_fill_a_short_group_with_loss_free_rows():
    config = BatchingConfig(cutoff_len=64, micro_batch_size=2)  # 5 rows: the last micro-batch has one
    plain, filled = DataPlan(sft_dataset(n_rows=5), config), DataPlan(sft_dataset(n_rows=5), replace(config,
                                                                                                     equal_rows=True))
    short, full = plain.micro_batch(0, 2), filled.micro_batch(0, 2)
    assert short.tokens.shape[0] == 1 and full.tokens.shape[0] == 2 and full.loss_mask[1].sum() == 0
    for name in ("num_real_tokens", "num_loss_tokens", "num_data_tokens"):
        assert getattr(full, name) == getattr(short, name), name


def test_documents_split_into_overlapping_pieces_train_every_token_once():
    from llamafactory_mca.data.rows import split_documents

    documents = [list(range(100 * d, 100 * d + n)) for d, n in enumerate((3, 8, 9, 10, 21))]
    pieces = split_documents(datasets.Dataset.from_list([{"input_ids": d} for d in documents]), cutoff_len=4)
    plan = DataPlan(pieces, BatchingConfig(cutoff_len=4, micro_batch_size=1, packing=True, shuffle=False))
    assert plan.stats["documents"] == 5 and plan.stats["pieces"] == len(pieces) == 1 + 2 + 2 + 3 + 5
    assert plan.stats["rows_truncated"] == 0 and plan.stats["data_tokens"] == sum(map(len, documents))
    targets = [t for batch in stream(plan, epochs=1) for t in batch.labels[batch.loss_mask.bool()].tolist()]
    assert sorted(targets) == sorted(t for d in documents for t in d[1:])  # every token but the first, once
    assert sum(b.num_data_tokens for b in stream(plan, epochs=1)) == sum(map(len, documents))
    assert "5 documents in 13 pieces of at most cutoff_len" in format_stats(plan.stats)


def test_tokenizing_workers_run_torch_on_one_thread_each():
    """datasets' forked map workers inherit the parent's torch threads: several workers x every core oversubscribed
    the image processor's small tensors (LLaMA-Factory's tokenization, 11x slower on a 16-core GPU host)."""
    from llamafactory_mca.data.rows import one_thread_per_worker

    rows = datasets.Dataset.from_list([{"i": i} for i in range(4)])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread_per_worker(2):
            seen = rows.map(lambda row: {"threads": torch.get_num_threads()}, num_proc=2)["threads"]
        assert seen == [1, 1, 1, 1] and torch.get_num_threads() == 2  # the parent has its threads back
        for workers in (None, 1):  # no workers: the parent tokenizes, with all its threads
            with one_thread_per_worker(workers):
                assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


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
    assert (stats["rows_dropped_short"], stats["rows_dropped_no_loss"]) == (2, 1)
    assert stats["rows_truncated"] == 1
    assert stats["tokens"] == 9 + 16 and stats["loss_tokens"] == 8 + 15
    assert stats["padded_tokens"] == 16 + 16 and stats["packing_efficiency"] == pytest.approx(25 / 32)  # TILE
    assert stats["micro_batches"] == 2 and format_stats(stats) in caplog.text
    batch = next(b for b in stream(plan, epochs=1) if rows_of(b) == [4])
    assert batch.tokens[0].tolist() == [4000 + j for j in range(16)]
    assert batch.labels[0].tolist() == [IGNORE_INDEX] + [4000 + j for j in range(2, 17)]


def test_pairwise_plan_keeps_pairs_and_drops_incomplete_ones():
    rows = [pair_row(i, 5 + i % 4, 4 + i % 3) for i in range(12)]
    rows[5]["rejected_labels"] = [IGNORE_INDEX] * len(rows[5]["rejected_labels"])  # a side without loss: drop the pair
    dataset = datasets.Dataset.from_list(rows)
    packed = DataPlan(dataset, BatchingConfig(cutoff_len=16, micro_batch_size=2, packing=True, pad_multiple=2))
    assert packed.kind == "pairwise" and packed.stats["rows_dropped_no_loss"] == 1 and packed.capacity == 64
    assert packed.micro_batch(0, 0).ref_chosen_logps is None  # until the trainer computes them
    packed.set_reference(-np.arange(12, dtype=np.float32), -np.arange(12, dtype=np.float32) - 0.5)
    pairs = []
    for batch in stream(packed, epochs=1):
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
    # the pack rounds up to a multiple of TILE, here its capacity
    assert batch.labels[0, :2].tolist() == [8, 9] and batch.cu_seqlens.tolist() == [0, 2, 4, 16]


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


def test_audios_are_refused_and_empty_audio_columns_are_not():
    """LLaMA-Factory keeps a row's audios beside its tokens; no model here hears them, and their placeholders would
    train on nothing: one line. A column of nothing (text rows of a multimodal dataset) plans as usual."""
    from llamafactory_mca.errors import UserError

    rows = [sft_row(i, 6) | {"audios": [] if i else ["a.wav"]} for i in range(3)]
    with pytest.raises(UserError, match="the dataset has audios"):
        DataPlan(datasets.Dataset.from_list(rows), BatchingConfig(cutoff_len=8))
    silent = [sft_row(i, 6) | {"audios": None} for i in range(3)]
    assert DataPlan(datasets.Dataset.from_list(silent), BatchingConfig(cutoff_len=8)).stats["rows_kept"] == 3
