"""Which tokens of a row are the dataset's own text, and which the chat template put around it.

A row whose instruction, input and output are all empty still tokenizes to the template's frame (role headers,
the end-of-turn token), and LLaMA-Factory trains it: the end token carries loss. A whole dataset of such rows
(a wrong ``columns`` mapping in dataset_info.json reads every field as empty) would train on nothing but the
template and look healthy. To tell them apart we ask LLaMA-Factory's own processor for the stage to tokenize
empty conversations (one turn and two, the template's default system prompt included): the ids it produces are the
template's. A row is empty when every token of it is one of them; the rows counted in the summary and the refusal
when no loss token of the dataset is its own follow from that (``rows.scan_rows``, ``loader.check_trainable``).

A set, not a sequence match: a row whose every token also occurs in the template's own text (an answer ``.``
beside a default system prompt that ends with one) counts as empty. Real text has other tokens; the price of the
simple test is a miscount in a warning, never a row dropped.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np


def _empty_examples(turns: int, responses: int) -> dict[str, list]:
    """LLaMA-Factory's aligned columns for conversations of ``turns`` empty turns (``responses`` answers each: 2 for
    a preference pair)."""
    prompts = [[{"role": role, "content": ""} for _ in range(n) for role in ("user", "assistant")][:-1]
               for n in range(1, turns + 1)]
    count = len(prompts)
    return {"_prompt": prompts, "_response": [[{"role": "assistant", "content": ""}] * responses] * count,
            "_system": [""] * count, "_tools": [""] * count, "_images": [None] * count, "_videos": [None] * count,
            "_audios": [None] * count}


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def template_tokens(stage: str, template: Any, tokenizer: Any, processor: Any, data_args: Any) -> np.ndarray:
    """The token ids LLaMA-Factory's processing for ``stage`` (pt, sft, dpo or kto) adds around a row's own text."""
    # here: LLaMA-Factory's data processors import seconds of modules; data/ loads without them
    from llamafactory.data.processor import (
        FeedbackDatasetProcessor,
        PairwiseDatasetProcessor,
        PretrainDatasetProcessor,
        SupervisedDatasetProcessor,
    )

    args = copy.copy(data_args)  # whole rows, unpacked: the frame of one row, as the workflow asks for them
    args.packing, args.neat_packing, args.cutoff_len = False, False, 2**20
    if stage == "pt":
        cls, columns, examples = PretrainDatasetProcessor, ("input_ids",), _empty_examples(1, 1)
    elif stage == "dpo":
        cls, columns, examples = PairwiseDatasetProcessor, ("chosen_input_ids", "rejected_input_ids"), \
            _empty_examples(2, 2)
    elif stage == "kto":
        cls, columns, examples = FeedbackDatasetProcessor, ("input_ids", "kl_input_ids"), _empty_examples(2, 2)
    else:
        cls, columns, examples = SupervisedDatasetProcessor, ("input_ids",), _empty_examples(2, 1)
    with _quiet(cls.__module__):  # its warnings are about these made-up rows (KTO's: "only one preference type")
        rows = cls(template=template, tokenizer=tokenizer, processor=processor, data_args=args
                   ).preprocess_dataset(examples)
    ids = [token for column in columns for row in rows[column] for token in row]
    return np.unique(np.asarray(ids, dtype=np.int64))
