"""Every pipeline layout Megatron accepts, at every micro-batch count, trains without hanging and gives the HF loss.

One 4-process gloo run walks the matrix PP in {2, 4} x VPP x micro-batches per step, rebuilding Megatron's process
groups for each case: an 8-layer tiny Qwen3, rows of different lengths (so each step pads to its longest), two
optimizer steps through McaTrainer (the real step: StepFeeder, Megatron's schedules, DDP, optimizer). Step 1's
loss must equal the Hugging Face model's per-token loss over the same rows; step 2's must be finite. The cases
Megatron refuses (interleaved with a micro-batch count that is not a multiple of PP) are refused by our layout
check before any process group exists.
"""

import math

import pytest
import torch

from llamafactory_mca.tiny import save_tiny_model
from tests._dist import run_distributed


pytestmark = pytest.mark.slow
WORLD, LAYERS, VOCAB = 4, 8, 200


def _cases() -> list[tuple[int, int | None, int]]:
    cases = []
    for pp in (2, 4):
        for vpp in (None, 2, 4):
            if LAYERS % (pp * (vpp or 1)):
                continue
            counts = (pp, 2 * pp) if vpp else (1, 2, 3, pp + 1, 2 * pp)
            cases += [(pp, vpp, m) for m in sorted(set(counts))]
    return cases


CASES = _cases()


def _rows(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = 9 + (7 * i) % 23  # 9..31 tokens: every step pads its micro-batches to its longest
        ids = torch.randint(5, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return rows


def _hf_loss(model_dir: str, rows: list[dict]) -> float:
    """Σ token losses / Σ loss tokens over ``rows``, shifted as our data path does (inside each row)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids, labels = torch.tensor(row["input_ids"]), torch.tensor(row["labels"])
            logits = model(ids[None, :-1]).logits[0]
            target = labels[1:]
            mask = target != -100
            total += torch.nn.functional.cross_entropy(logits[mask], target[mask], reduction="sum").item()
            count += int(mask.sum())
    return total / count


def _walk(model_dir: str, out_dir: str, cases: list) -> list[tuple]:
    from datasets import Dataset
    from megatron.core import parallel_state as ps

    from llamafactory_mca import parallel
    from llamafactory_mca.data import BatchingConfig, DataPlan
    from llamafactory_mca.models.auto import AutoModel
    from llamafactory_mca.trainer.trainer import McaTrainer
    from llamafactory_mca.training_args import TrainingArguments

    from llamafactory_mca import watchdog

    dataset = Dataset.from_list(_rows(64))
    results = []
    parallel.init_distributed(60)
    watchdog.start(60, torch.distributed.get_rank())  # a hang ends this rank (and the test) after a minute
    for pp, vpp, micro in cases:
        args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=micro,
                                 pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                 learning_rate=1e-3, max_steps=2, logging_steps=1, save_strategy="no",
                                 report_to="none", disable_tqdm=True, seed=0)
        layout = args.resolve_layout(WORLD, seq_length=32)
        parallel.initialize(layout, seed=0)
        model = AutoModel.from_pretrained(model_dir, args)
        plan = DataPlan(dataset, BatchingConfig(cutoff_len=32, micro_batch_size=1, pad_multiple=layout.pad_multiple),
                        log=False)
        trainer = McaTrainer(model=model, args=args, layout=layout, train_data=plan)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        rows = [dataset[int(i)] for group in plan.epoch_groups(0)[: layout.dp * micro] for i in group]
        results.append(((pp, vpp, micro), losses, _hf_loss(model_dir, rows)))
        del trainer, model
        ps.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def schedule_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("schedules")
    model_dir = save_tiny_model("qwen3", str(root / "model"), num_hidden_layers=LAYERS)
    results = run_distributed(_walk, WORLD, model_dir, str(root / "out"), CASES)
    return {case: (losses, reference) for case, losses, reference in results[0]}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"pp{c[0]}-vpp{c[1] or 1}-m{c[2]}")
def test_pipeline_layout_trains_with_the_hf_loss(case, schedule_results):
    losses, reference = schedule_results[case]
    assert len(losses) == 2, (case, losses)
    assert losses[0] == pytest.approx(reference, rel=1e-4), (case, losses, reference)
    assert math.isfinite(losses[1]) and losses[1] < losses[0] + 1.0, (case, losses)


@pytest.mark.parametrize("pp,vpp,micro", [(2, 2, 1), (2, 2, 3), (4, 2, 6)])
def test_interleaved_micro_batch_counts_megatron_refuses_are_refused_first(pp, vpp, micro, tmp_path):
    from llamafactory_mca.errors import UserError
    from llamafactory_mca.training_args import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=micro,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    with pytest.raises(UserError, match=f"gradient_accumulation_steps={micro} must be a multiple of "
                                        f"pipeline_model_parallel_size={pp}"):
        args.resolve_layout(world_size=WORLD)
