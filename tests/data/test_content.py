"""Rows with no text of their own: counted, kept and warned about when among real ones; a dataset whose loss would
fall on nothing but the chat template's tokens is refused, for sft, dpo pairs and pt alike."""

import datasets
import pytest

from llamafactory_mca.data import BatchingConfig, DataPlan, check_trainable, empty_rows_warning, format_stats
from llamafactory_mca.errors import UserError
from llamafactory_mca.tools.tiny import alpaca_rows
from tests.data.fixtures import sft_row, tokenized_with_frame


EMPTY = {"instruction": "", "input": "", "output": ""}


def plan_of(dataset, frame, cutoff_len: int = 64) -> DataPlan:
    return DataPlan(dataset, BatchingConfig(cutoff_len=cutoff_len, micro_batch_size=2), log=False,
                    template_tokens=frame)


def test_the_frame_is_the_templates_tokens_only(tmp_path):
    _, tokenizer, frame = tokenized_with_frame(str(tmp_path), rows=alpaca_rows(2) + [EMPTY])
    assert set(tokenizer.convert_ids_to_tokens(frame.tolist())) == {"<|im_start|>", "user", "assistant", "<|im_end|>"}


def test_empty_rows_among_real_ones_are_kept_counted_and_warned_about(tmp_path):
    """LLaMA-Factory's default path trains an empty row (its end-of-turn token carries loss): so do we, saying so."""
    rows = alpaca_rows(4) + [EMPTY, {"instruction": "Explain rain .", "input": "", "output": ""}]
    dataset, _, frame = tokenized_with_frame(str(tmp_path), rows=rows)
    stats = plan_of(dataset, frame).stats
    assert (stats["rows"], stats["rows_kept"], stats["rows_empty"], stats["rows_empty_answer"]) == (6, 6, 1, 1)
    assert "6 rows, 6 kept, 1 empty (nothing but template tokens), 1 with an empty answer" in format_stats(stats)
    check_trainable(stats, dataset="tiny_alpaca")
    warning = empty_rows_warning(stats, dataset="tiny_alpaca")
    assert warning.startswith("dataset=tiny_alpaca: 1 empty") and "1 with an empty answer" in warning
    assert "\n" not in warning
    # without the template's tokens nothing is counted: every token is the dataset's
    plain = plan_of(dataset, None).stats
    assert (plain["rows_kept"], plain["rows_empty"], plain["rows_empty_answer"]) == (6, 0, 0)
    assert empty_rows_warning(plain, dataset="tiny_alpaca") is None


@pytest.mark.parametrize("stage,rows", [
    ("sft", [EMPTY] * 3),
    ("sft", [{"instruction": "Explain rain .", "input": "", "output": ""}] * 3),  # prompts, but every answer empty
    ("rm", [{"instruction": "", "input": "", "chosen": "", "rejected": ""}] * 3),
])
def test_a_dataset_of_template_tokens_only_is_refused(tmp_path, stage, rows):
    dataset, _, frame = tokenized_with_frame(str(tmp_path), stage=stage, rows=rows)
    stats = plan_of(dataset, frame).stats
    assert stats["rows_kept"] == 3 and stats["content_loss_tokens"] == 0
    with pytest.raises(UserError) as caught:
        check_trainable(stats, dataset="tiny_alpaca")
    message = str(caught.value)
    assert message.startswith("dataset=tiny_alpaca: nothing but the chat template's tokens would carry loss in its 3 "
                              "rows") and "dataset_info.json" in message and "\n" not in message


def test_pretraining_documents_of_template_tokens_only_are_refused(tmp_path):
    """pt: an empty document is the end-of-text token alone, nothing to predict; with a bos token in front it has a
    target, but only the template's."""
    dataset, _, frame = tokenized_with_frame(str(tmp_path), stage="pt", rows=[EMPTY] * 3)
    stats = plan_of(dataset, frame).stats
    with pytest.raises(UserError, match="has no row left to train on: of 3 rows read, 3 have fewer than two tokens"):
        check_trainable(stats, dataset="tiny_text")
    bos, eos = 7, 8
    documents = datasets.Dataset.from_list([{"input_ids": [bos, eos]}] * 2 + [{"input_ids": [bos, 20, 21, eos]}])
    stats = plan_of(documents, [bos, eos]).stats
    assert (stats["rows_kept"], stats["rows_empty"]) == (3, 2)
    check_trainable(stats, dataset="tiny_text")
    assert "to end a text at once" in empty_rows_warning(stats, dataset="tiny_text")
    with pytest.raises(UserError, match=r"in its 2 rows \(2 of them empty\): training would only teach the end of a"):
        check_trainable(plan_of(documents.select([0, 1]), [bos, eos]).stats, dataset="tiny_text")


def test_no_row_left_says_why_before_any_summary():
    rows = [sft_row(0, 1), sft_row(1, 6, prompt=6), sft_row(2, 30, prompt=20)]  # 1 token; prompt only; prompt > cutoff
    plan = plan_of(datasets.Dataset.from_list(rows), None, cutoff_len=16)
    with pytest.raises(UserError) as caught:
        next(plan.steps())
    assert str(caught.value) == (
        "the dataset has no row left to train on: of 3 rows read, 1 have fewer than two tokens (nothing to predict) "
        "and 2 no loss token within cutoff_len=16 (the prompt fills cutoff_len, or every label is masked). Check the "
        "dataset's columns in dataset_info.json, or raise cutoff_len.")
    with pytest.raises(UserError, match="^dataset=tiny_alpaca has no row left to train on: of 3 rows read"):
        check_trainable(plan.stats, dataset="tiny_alpaca")
