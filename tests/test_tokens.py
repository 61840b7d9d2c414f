"""Every token trained once per epoch, through ``llamafactory-cli train``, against LLaMA-Factory's default
path on the same data. (Every layout's epoch accounting is in tests/test_layouts.py.)
"""

import json
import os
import re

import pytest

from llamafactory_mca.tools.tiny import SENTENCES, TOPICS
from tests._cli import losses, ok, recipe, run_default_path, train


pytestmark = pytest.mark.slow


def _state(output_dir) -> dict:
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        return json.load(f)


def _default_path(tmp_path, config: dict, name: str) -> dict:
    """The same recipe through LLaMA-Factory's own trainer (no USE_MCA), on the CPU: its trainer state."""
    return _state(run_default_path(tmp_path, config, name))


def _pt_data(folder, texts: list[str]) -> str:
    os.makedirs(folder)
    with open(os.path.join(folder, "docs.json"), "w") as f:
        json.dump([{"text": t} for t in texts], f)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"docs": {"file_name": "docs.json", "columns": {"prompt": "text"}}}, f)
    return str(folder)


def _tokens(model_dir: str, text: str) -> int:
    """A pt document's tokens as LLaMA-Factory makes them: the text and the end-of-text token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return len(tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"])


def _document(i: int, sentences: int) -> str:
    return " ".join(SENTENCES[(i + k) % 4].format(topic=TOPICS[(3 * i + k) % len(TOPICS)]) for k in range(sentences))


def test_pt_documents_train_whole_and_no_less_than_llamafactory(assets, tmp_path):
    texts = [_document(i, 12 + 9 * i) for i in range(6)]  # 3 to 10 times cutoff_len
    expected = sum(_tokens(assets["models"]["qwen3"], t) for t in texts)
    data = _pt_data(tmp_path / "data", texts)
    config = recipe(assets, tmp_path / "mca", stage="pt", dataset="docs", dataset_dir=data,
                    cutoff_len=32, max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=3,
                    include_num_input_tokens_seen=True, sequence_packing=True)
    result, output = train(tmp_path, config, world=2)
    ok(result, output)
    assert "data (pt): 6 documents in" in output and "0 reach cutoff_len and were truncated" in output
    ours = _state(tmp_path / "mca")
    assert ours["num_input_tokens_seen"] == expected and ours["epoch"] == pytest.approx(1.0), (ours, expected)
    theirs = _default_path(tmp_path, config, "default")
    assert 0 < theirs["num_input_tokens_seen"] <= ours["num_input_tokens_seen"], (theirs, ours)


def test_sft_epoch_with_a_short_last_step_trains_what_llamafactory_trains(assets, tmp_path):
    # 50 rows, 2 per micro-batch: 25 micro-batches, 4 per step at DP2: 6 steps and a last one of 1
    config = recipe(assets, tmp_path / "mca", cutoff_len=512, max_steps=-1, num_train_epochs=1,
                    gradient_accumulation_steps=2, include_num_input_tokens_seen="non_padding")
    result, output = train(tmp_path, config, world=2)
    ok(result, output)
    ours = _state(tmp_path / "mca")
    assert (ours["global_step"], ours["epoch"]) == (7, pytest.approx(1.0)), ours
    theirs = _default_path(tmp_path, {**config, "gradient_accumulation_steps": 4}, "default")
    assert ours["num_input_tokens_seen"] == theirs["num_input_tokens_seen"], (ours, theirs)


def test_pt_first_step_loss_is_llamafactory_corrected_for_its_unpredicted_first_label(assets, tmp_path):
    """LLaMA-Factory's default path divides a block's summed loss by all n labels, the first included, which is never
    predicted (the HF Trainer counts labels before the shift): it reports (n - 1) / n of the per-token mean. The
    recipe does not ask for packing: LLaMA-Factory packs pt by itself, and the plan, which decides it, says so in the
    summary."""
    text = _document(0, 6)
    n = _tokens(assets["models"]["qwen3"], text)  # the document is exactly one block
    data = _pt_data(tmp_path / "data", [text])
    config = recipe(assets, tmp_path / "mca", stage="pt", dataset="docs", dataset_dir=data,
                    cutoff_len=n, max_steps=1, per_device_train_batch_size=1, gradient_accumulation_steps=1)
    result, output = train(tmp_path, config)
    ok(result, output)
    assert "tokens per step (packed)" in output, output[-3000:]
    # where the first wait goes: the launcher (which forks the ranks with everything imported), rank 0, step 1
    startup = re.search(r"startup     ([\d.]+) s from the command to training: launcher ([\d.]+) s \(LLaMA-Factory's "
                        r"imports and the recipe's checks ([\d.]+) s, the ranks' imports ([\d.]+) s, forking "
                        r"[\d.]+ s\); rank 0: arguments and process group [\d.]+ s, data ", output)
    assert startup and "Step 1 took " in output, output[-3000:]
    total, launcher, checks, imports = map(float, startup.groups())
    # each printed to 0.1 s: two rounded phases may exceed their rounded sum by up to 0.1 s
    assert 0 < checks + imports <= launcher + 0.15 and launcher <= total + 0.1, startup.group(0)
    ours = losses(tmp_path / "mca")[1]
    _default_path(tmp_path, config, "default")
    theirs = losses(tmp_path / "default")[1]
    assert ours == pytest.approx(theirs * n / (n - 1), rel=1e-4), (ours, theirs, n)
