"""Offline stand-ins for a real tokenizer and dataset: LLaMA-Factory's own processing runs on them in tests.

The tokenizer and dataset builders live in ``llamafactory_mca.tools.tiny`` (the demo and benchmarks use them too).
``tokenized_dataset`` runs LLaMA-Factory's ``get_template_and_fix_tokenizer`` + ``get_dataset`` on both.
``sft_row`` / ``pair_row`` build synthetic tokenized rows whose token values name their row and position.
"""

from __future__ import annotations

import os
from typing import Any

from llamafactory_mca.tools.tiny import save_tiny_tokenizer, write_alpaca_dataset


IGNORE_INDEX = -100


def make_tiny_tokenizer(directory: str) -> str:
    return save_tiny_tokenizer(os.path.join(directory, "tiny_tokenizer"))


def tokenized_dataset(tmp_dir: str, n_rows: int = 6, cutoff_len: int = 64, template: str = "qwen3_nothink",
                      stage: str = "sft", rows: list[dict] | None = None) -> tuple[Any, Any]:
    """LLaMA-Factory's tokenized train split and the tokenizer, as our workflow gets them.

    ``stage`` is LLaMA-Factory's: "pt", "sft" or "rm" (pairwise rows, what DPO trains on). ``cutoff_len`` is the
    user's value; like the workflow, we ask LLaMA-Factory for ``cutoff_len + 1`` tokens. ``rows``: alpaca rows to
    write instead of ``n_rows`` generated ones.
    """
    dataset, tokenizer, _ = tokenized_with_frame(tmp_dir, n_rows, cutoff_len, template, stage, rows)
    return dataset, tokenizer


def tokenized_with_frame(tmp_dir: str, n_rows: int = 6, cutoff_len: int = 64, template: str = "qwen3_nothink",
                         stage: str = "sft", rows: list[dict] | None = None) -> tuple[Any, Any, Any]:
    """``tokenized_dataset`` and the token ids the template frames each row with (``data/content.py``)."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments, ModelArguments
    from transformers import AutoTokenizer, Seq2SeqTrainingArguments

    from llamafactory_mca.data.content import template_tokens

    tokenizer_path = make_tiny_tokenizer(tmp_dir)
    dataset_dir = write_alpaca_dataset(tmp_dir, n_rows, ranking=stage == "rm", rows=rows)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model_args = ModelArguments(model_name_or_path=tokenizer_path, cache_dir=os.path.join(tmp_dir, "cache"))
    data_args = DataArguments(template=template, dataset="tiny_alpaca", dataset_dir=dataset_dir,
                              cutoff_len=cutoff_len + 1, overwrite_cache=True, packing=False)
    training_args = Seq2SeqTrainingArguments(output_dir=os.path.join(tmp_dir, "out"), report_to="none")
    template_obj = get_template_and_fix_tokenizer(tokenizer, data_args)
    module = get_dataset(template_obj, model_args, data_args, training_args, stage=stage, tokenizer=tokenizer,
                         processor=None)
    frame = template_tokens("dpo" if stage == "rm" else stage, template_obj, tokenizer, None, data_args)
    return module["train_dataset"], tokenizer, frame


# Synthetic rows for the unit tests: token values say which row and position they come from.


def sft_row(i: int, n: int, prompt: int = 2) -> dict:
    """Row ``i`` with ``n`` tokens valued ``1000 i + j``: every token names its row and position."""
    ids = [1000 * i + j for j in range(n)]
    return {"input_ids": ids, "attention_mask": [1] * n, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def pair_row(i: int, n_chosen: int, n_rejected: int) -> dict:
    chosen, rejected = sft_row(i, n_chosen), sft_row(i + 500, n_rejected)
    return {f"chosen_{k}": v for k, v in chosen.items()} | {f"rejected_{k}": v for k, v in rejected.items()}
