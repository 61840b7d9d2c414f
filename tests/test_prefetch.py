"""``prefetch_steps``: a step's micro-batches are collated on a background thread while the step before trains.

The thread must change nothing but when the work happens: the same micro-batches in the same order, the same
losses through the real command (a vision-language model, whose pixels and 3-D positions are what the thread takes
off the step's critical path), an error raised where the step that needed it is due, and no thread left behind.
"""

import threading
import time

import pytest
import yaml

from llamafactory_mca.errors import UserError
from llamafactory_mca.tools.tiny import save_tiny_vl_model, write_image_dataset
from llamafactory_mca.trainer.feeder import ahead
from tests._cli import cli_env, losses, ok, one_error, recipe, run, train


def _collators() -> int:
    return sum(t.name == "llamafactory-mca-collate" for t in threading.enumerate())


def test_ahead_keeps_order_and_raises_where_the_item_was_due():
    assert list(ahead(iter(range(50)), 3)) == list(range(50))
    assert list(ahead(iter(range(5)), 0)) == list(range(5))

    def failing():
        yield 1
        yield 2
        raise UserError("row 7 has no text")

    got = []
    with pytest.raises(UserError, match="row 7"):
        for item in ahead(failing(), 2):
            got.append(item)
    assert got == [1, 2]


def test_ahead_stops_its_thread_when_let_go():
    def forever():
        n = 0
        while True:
            n += 1
            yield n

    before = _collators()
    items = ahead(forever(), 2)
    assert [next(items) for _ in range(3)] == [1, 2, 3]
    assert _collators() == before + 1
    items.close()  # what happens when the run stops at max_steps
    deadline = time.time() + 5
    while _collators() > before and time.time() < deadline:
        time.sleep(0.05)
    assert _collators() == before


def test_prefetch_trains_what_collating_in_the_step_trains(tmp_path):
    """Qwen2-VL packed, three steps with evaluation between them: the losses collating one step ahead (the GPUs'
    default) equal those of prefetch_steps: 0 (each step collating its own micro-batches, pixels included: the
    CPUs' default)."""
    model = save_tiny_vl_model("qwen2_vl", str(tmp_path / "model"))
    data = write_image_dataset(str(tmp_path), 12)
    assets = {"models": {"qwen3": model}, "sft": data}
    vl = dict(dataset="tiny_images", template="qwen2_vl", cutoff_len=256, gradient_accumulation_steps=2, max_steps=3,
              image_max_pixels=768, image_min_pixels=256, sequence_packing=True, per_device_train_batch_size=2,
              eval_dataset="tiny_images", eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    runs = {}
    for prefetch in (0, 1):
        name = f"prefetch_{prefetch}"
        result, output = train(tmp_path, recipe(assets, tmp_path / name, **vl, prefetch_steps=prefetch), name=name)
        ok(result, output)
        runs[prefetch] = losses(tmp_path / name)
        assert "eval loss" in output
    assert runs[0].keys() == runs[1].keys() == {1, 2, 3}
    assert runs[1] == runs[0]


def test_negative_prefetch_is_refused(tmp_path, assets):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(assets, tmp_path / "out", prefetch_steps=-1)))
    result, output = run(["llamafactory-cli", "train", str(path)], env=cli_env(1), alone=False)
    one_error(result, output, "prefetch_steps=-1 must be >= 0")
    assert not (tmp_path / "out").exists()
