"""Every recipe in examples/megatron runs as written, for two steps, through ``USE_MCA=1 llamafactory-cli train``.

What changes: the model is a tiny one of the same family, put into a fake Hugging Face cache under the recipe's own
hub id (``HF_HUB_OFFLINE=1``), so the hub-id path is the one a user's run takes; the data is present where the
recipe looks for it (LLaMA-Factory's ``data/`` folder layout for its demo sets, ``examples/data`` for ours), in the
same formats, with rows made here; ``max_steps=2`` and ``output_dir`` are overridden, and ``cutoff_len`` is 1024
(packs of 1k tokens, not 4k: a CPU rank's step time is its tokens) except in the long-context recipe, whose point is
its length. Layouts, packing, precision and every Megatron key stay as written; on a machine without GPUs each rank
is a CPU process.
"""

import glob
import json
import os
import re
import shutil

import pytest
import yaml

from llamafactory_mca.tools.tiny import (
    GEMMA_TOKENS,
    GLM_TOKENS,
    GPT_OSS_TOKENS,
    MINIMAX_TOKENS,
    SENTENCES,
    TINY_VL,
    TOPICS,
    save_tiny_model,
    save_tiny_tokenizer,
    save_tiny_vl_model,
    write_image_dataset,
)
from tests._cli import cli_env, fake_hub_cache, losses, ok, run


pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "megatron", "*.yaml")))
FAMILY = {"Qwen/Qwen3-1.7B": "qwen3", "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3_moe",
          "Qwen/Qwen2-VL-7B-Instruct": "qwen2_vl", "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_moe",
          "zai-org/GLM-4.5-Air": "glm4_moe", "moonshotai/Moonlight-16B-A3B-Instruct": "deepseek_v3",
          "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3_next", "Qwen/Qwen3.5-27B": "qwen3_5",
          "Qwen/Qwen3.5-35B-A3B": "qwen3_5_moe", "google/gemma-3-1b-it": "gemma3_text",
          "openai/gpt-oss-120b": "gpt_oss", "zai-org/GLM-4.5V": "glm4v_moe",
          "google/gemma-3-27b-it": "gemma3", "MiniMaxAI/MiniMax-M2": "minimax_m2",
          "OpenGVLab/InternVL3_5-38B-HF": "internvl", "zai-org/GLM-5": "glm_moe_dsa",
          "google/gemma-4-31B-it": "gemma4", "google/gemma-4-26B-A4B-it": "gemma4_moe",
          "google/gemma-4-E4B-it": "gemma4_e2b"}
# LLaMA-Factory's own dataset_info.json entries for its demo sets (data/dataset_info.json in its repository).
LLAMAFACTORY_INFO = {
    "identity": {"file_name": "identity.json"},
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "dpo_en_demo": {"file_name": "dpo_en_demo.json", "ranking": True, "formatting": "sharegpt",
                    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
    "kto_en_demo": {"file_name": "kto_en_demo.json", "formatting": "sharegpt",
                    "columns": {"messages": "messages", "kto_tag": "label"},
                    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                             "assistant_tag": "assistant"}},
}


def _sentence(i: int, repeat: int = 1) -> str:
    return " ".join(SENTENCES[(i + k) % 4].format(topic=TOPICS[(i * 7 + k) % len(TOPICS)]) for k in range(repeat))


def _write(path: str, rows: list) -> None:
    with open(path, "w") as f:
        json.dump(rows, f)


def _llamafactory_data(folder: str) -> None:
    """LLaMA-Factory's data/ layout: identity, alpaca_en_demo (alpaca format), dpo_en_demo (sharegpt pairs),
    kto_en_demo (sharegpt messages tagged by a label column), mllm_demo (sharegpt messages with images beside them)."""
    images = write_image_dataset(os.path.dirname(folder), 24, name="mllm_demo")  # writes <root>/data
    with open(os.path.join(images, "dataset_info.json")) as f:
        mllm = json.load(f)
    _write(os.path.join(folder, "dataset_info.json"), {**LLAMAFACTORY_INFO, **mllm})
    _write(os.path.join(folder, "identity.json"),
           [{"instruction": _sentence(i), "input": "", "output": _sentence(i + 1)} for i in range(100)])
    _write(os.path.join(folder, "alpaca_en_demo.json"),
           [{"instruction": _sentence(i), "input": "", "output": _sentence(i + 2, 1 + i % 3)} for i in range(1000)])
    _write(os.path.join(folder, "dpo_en_demo.json"),
           [{"conversations": [{"from": "human", "value": _sentence(i)}],
             "chosen": {"from": "gpt", "value": _sentence(i + 1, 2)},
             "rejected": {"from": "gpt", "value": _sentence(i + 3)}} for i in range(700)])
    _write(os.path.join(folder, "kto_en_demo.json"),
           [{"messages": [{"role": "user", "content": _sentence(i)},
                          {"role": "assistant", "content": _sentence(i + 1)}], "label": i % 3 != 0}
            for i in range(300)])


def _our_data(folder: str) -> None:
    """examples/data as the recipes expect it, with the hub-hosted sets as local files in the same format."""
    shutil.copytree(os.path.join(ROOT, "examples", "data"), folder)
    with open(os.path.join(folder, "dataset_info.json")) as f:
        info = json.load(f)
    for name, entry in info.items():
        if "hf_hub_url" in entry:
            entry["file_name"] = f"{name}.json"
            del entry["hf_hub_url"]
    _write(os.path.join(folder, "dataset_info.json"), info)
    # ~2k-token conversations, enough for 4 packs of 32k: a CPU spends its time on attention, which grows with length
    _write(os.path.join(folder, "long_align_10k.json"),
           [{"messages": [{"role": "user", "content": _sentence(i, 200)},
                          {"role": "assistant", "content": _sentence(i + 1, 20)}]} for i in range(60)])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A working folder with the data in place and a fake hub cache holding a tiny model per recipe model id."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("examples")
    _llamafactory_data(str(root / "data"))
    _our_data(str(root / "examples" / "data"))
    tokenizer = save_tiny_tokenizer(str(root / "tokenizer"))
    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    for repo, family in FAMILY.items():
        if family in TINY_VL:
            # Qwen3.5-MoE, GLM-4.5V, Gemma 4 26B-A4B: as many experts as their recipes' expert parallel size (8);
            # Gemma 3: as many kv heads as its tensor parallel size (4); InternVL: a layer per virtual pipeline stage
            # (4 x 2)
            extra = {"qwen3_5_moe": {"num_experts": 8}, "glm4v_moe": {"n_routed_experts": 8},
                     "gemma3": {"num_key_value_heads": 4}, "internvl": {"num_hidden_layers": 8},
                     "gemma4_moe": {"num_experts": 8}}.get(family)
            model = save_tiny_vl_model(family, str(root / "models" / family), text_config=extra)
        else:
            # GLM-4.5 and 5, Moonlight, Qwen3-Next, gpt-oss, MiniMax-M2: as many experts as the recipes' expert
            # parallel size (8); GLM's, Gemma's, gpt-oss's and MiniMax's template tokens
            extra = {"glm4_moe": GLM_TOKENS, "glm_moe_dsa": GLM_TOKENS, "gemma3_text": GEMMA_TOKENS,
                     "gpt_oss": GPT_OSS_TOKENS, "minimax_m2": MINIMAX_TOKENS}.get(family, ())
            experts = ({"n_routed_experts": 8} if family in ("glm4_moe", "deepseek_v3", "glm_moe_dsa")
                       else {"num_experts": 8} if family == "qwen3_next"
                       else {"num_local_experts": 8} if family in ("gpt_oss", "minimax_m2") else {})
            model = save_tiny_model(family, str(root / "models" / family), vocab_size=vocab + len(extra), **experts)
            save_tiny_tokenizer(model, extra_special=extra)
        fake_hub_cache(str(root / "hub"), repo, model)
    return root


def test_every_example_is_covered():
    assert [os.path.basename(e) for e in EXAMPLES] == ["gemma3_1b_full.yaml", "gemma3_27b_full.yaml",
                                                       "gemma4_26b_a4b_full.yaml", "gemma4_31b_full.yaml",
                                                       "gemma4_e4b_full.yaml",
                                                       "glm4_5_air_lora.yaml",
                                                       "glm4_5v_lora.yaml", "glm5_lora.yaml",
                                                       "gpt_oss_120b_lora.yaml", "internvl3_5_38b_lora.yaml",
                                                       "minimax_m2_lora.yaml",
                                                       "moonlight_full.yaml", "qwen2_vl_full.yaml",
                                                       "qwen3_5_full.yaml", "qwen3_5_moe_full.yaml",
                                                       "qwen3_dense_sft.yaml", "qwen3_dpo.yaml",
                                                       "qwen3_kto_lora.yaml", "qwen3_long_context_cp2.yaml",
                                                       "qwen3_moe_full.yaml",
                                                       "qwen3_moe_lora.yaml", "qwen3_next_full.yaml",
                                                       "qwen3_rm.yaml", "qwen3_vl_moe_full.yaml"]
    for example in EXAMPLES:
        with open(example) as f:
            assert yaml.safe_load(f)["model_name_or_path"] in FAMILY, example


def test_readme_lists_every_recipe_and_only_recipes_that_exist():
    """README's recipe paragraph is how a reader finds the recipes: a recipe added without it, or a name left there
    after a rename, goes unnoticed otherwise."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    paragraph = re.search(r"Recipes in `examples/megatron/`(.*?)\.\n", readme, re.S)
    assert paragraph, "README lost its 'Recipes in `examples/megatron/`' paragraph"
    listed = re.findall(r"`([\w.-]+\.yaml)`", paragraph.group(1))
    assert sorted(listed) == sorted(os.path.basename(e) for e in EXAMPLES), listed
    assert len(listed) == len(set(listed)), listed
    named_anywhere = re.findall(r"examples/megatron/([\w.-]+\.yaml)", readme)
    for name in named_anywhere:
        assert os.path.isfile(os.path.join(ROOT, "examples", "megatron", name)), name


@pytest.mark.parametrize("example", EXAMPLES, ids=os.path.basename)
def test_example_trains_two_steps(example, world):
    out = world / "out" / os.path.basename(example)
    env = cli_env(None, {"HF_HUB_CACHE": str(world / "hub"), "HF_HUB_OFFLINE": "1"})
    shorter = [] if "long_context" in example else ["cutoff_len=1024"]
    result, output = run(["llamafactory-cli", "train", example, "max_steps=2", "logging_steps=1", *shorter,
                           f"output_dir={out}"], env=env, timeout=900, cwd=world)
    ok(result, output)
    assert sorted(losses(out)) == [1, 2], output[-3000:]
    assert os.path.isfile(out / "checkpoint-2" / "mca_config.json")
    assert any(name.endswith(".safetensors") for name in os.listdir(out))  # the final Hugging Face export
