"""Broken and missing files, through the real commands: each is one line that names the file, says it is corrupt or
missing and what to do, and the command leaves nothing behind.

A corrupt file of the right size is the case a size check cannot see: only reading it tells, and torch's own
errors (wrapped by its checkpoint loader, advising ``weights_only=False``) name no file. A missing folder must not be
reported as a malformed hub id, and a run that fails before training must not leave an empty output_dir. Where the
launcher can tell cheaply (safetensors headers, a checkpoint's metadata against its files, a missing output_dir),
the run stops before any worker starts, in seconds.
"""

import os
import pickle
import shutil
import sys

import pytest

from tests._cli import ok, one_error, recipe, run, train


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MERGE = os.path.join(ROOT, "scripts", "megatron_merge.py")
TORCH_ADVICE = ("weights_only", "miniz", "Traceback")


@pytest.fixture(scope="module")
def checkpoints(assets, tmp_path_factory):
    """An output_dir with checkpoint-2 and checkpoint-4 (the tests copy it before breaking it)."""
    tmp = tmp_path_factory.mktemp("ckpts")
    config = recipe(assets, tmp / "out", max_steps=4, save_strategy="steps", save_steps=2)
    result, output = train(tmp, config)
    ok(result, output)
    return tmp / "out", config


def _dist(checkpoint) -> str:
    return os.path.join(checkpoint, "dist_ckpt")


def _data_file(checkpoint) -> str:
    dist = _dist(checkpoint)
    return os.path.join(dist, sorted(n for n in os.listdir(dist) if n.endswith(".distcp"))[0])


def _garble_middle(path: str) -> None:
    """A third of the file, in its middle, overwritten with random bytes: the size stays."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 3)
        f.write(os.urandom(size // 3))


def _garble_all(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(os.urandom(size))


def _zero_start(path: str, offset: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * 4096)


def _weight_item(checkpoint) -> tuple[str, int]:
    """The data file and offset of the stored embedding, a tensor every merge reads."""
    with open(os.path.join(_dist(checkpoint), ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "embedding.word_embeddings.weight")
    return os.path.join(_dist(checkpoint), info.relative_path), info.offset


def _no_torch_advice(output: str) -> None:
    for text in TORCH_ADVICE:
        assert text not in output, output[-4000:]


def _break(checkpoint, what: str) -> str:
    """Break one file of ``checkpoint`` keeping its size; returns the file's path."""
    if what == "data, middle garbled":
        path = _data_file(checkpoint)
        _garble_middle(path)
    elif what == "data, a weight's first 4 KiB zeroed":
        path, offset = _weight_item(checkpoint)
        _zero_start(path, offset)
    elif what == "common.pt garbled":
        path = os.path.join(_dist(checkpoint), "common.pt")
        _garble_all(path)
    else:  # ".metadata garbled"
        path = os.path.join(_dist(checkpoint), ".metadata")
        _garble_all(path)
    return path


BREAKS = ("data, middle garbled", "data, a weight's first 4 KiB zeroed", "common.pt garbled", ".metadata garbled")


# ---- a corrupt checkpoint of full size: merge, resume, model_name_or_path ------------------------------------------


@pytest.mark.parametrize("what", BREAKS)
def test_merge_of_a_corrupt_checkpoint_names_the_file_and_leaves_nothing(checkpoints, tmp_path, what):
    source, _ = checkpoints
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(source / "checkpoint-4", checkpoint)
    broken = _break(checkpoint, what)
    command = [sys.executable, MERGE] if what.startswith("common") else ["llamafactory-mca", "merge"]
    result, output = run([*command, "--checkpoint_path", str(checkpoint), "--output_path", str(tmp_path / "hf")])
    one_error(result, output, broken, "corrupt")
    _no_torch_advice(output)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]  # no output folder, no temporary one


@pytest.mark.parametrize("what", ["data, whole file's first 4 KiB zeroed", "common.pt garbled", ".metadata garbled"])
def test_resume_from_a_corrupt_checkpoint_names_the_file_and_the_one_to_use(checkpoints, tmp_path, what):
    """The data file is found by the workers' load (its size is right), the other two by the launcher's check."""
    source, config = checkpoints
    out = tmp_path / "out"
    shutil.copytree(source, out)
    if what.startswith("data"):
        broken = _data_file(out / "checkpoint-4")
        _zero_start(broken)  # the first stored items' archive headers: only their structure tells
    else:
        broken = _break(out / "checkpoint-4", what)
    before = sorted(os.listdir(out))
    # LLaMA-Factory resumes from the newest checkpoint by itself when output_dir is kept
    result, output = train(tmp_path, {**config, "output_dir": str(out), "overwrite_output_dir": False})
    one_error(result, output, broken, "corrupt", f"resume_from_checkpoint: {out / 'checkpoint-2'}")
    _no_torch_advice(output)
    assert sorted(os.listdir(out)) == before


def test_a_corrupt_checkpoint_as_model_name_or_path_names_the_file(checkpoints, assets, tmp_path):
    source, _ = checkpoints
    model = tmp_path / "model"
    shutil.copytree(source / "checkpoint-4", model)
    broken = _break(model, "data, middle garbled")
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=str(model)))
    one_error(result, output, broken, "is corrupt")
    _no_torch_advice(output)
    assert not (tmp_path / "out").exists()


def test_a_truncated_checkpoint_as_model_name_or_path_is_refused_before_any_worker(checkpoints, assets, tmp_path):
    source, _ = checkpoints
    model = tmp_path / "model"
    shutil.copytree(source / "checkpoint-4", model)
    broken = _data_file(model)
    os.truncate(broken, 100)
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=str(model)))
    one_error(result, output, f"{broken} is truncated")
    assert "Initializing" not in output  # LLaMA-Factory's launcher never started torchrun
    assert not (tmp_path / "out").exists()


# ---- the model's safetensors: checked before any worker starts, and by convert ---------------------------------


def _model_with(assets, tmp_path, edit) -> str:
    model = tmp_path / "model"
    shutil.copytree(assets["models"]["qwen3"], model)
    path = str(model / "model.safetensors")
    edit(path)
    return path


@pytest.mark.parametrize("how, said", [("truncated", "is truncated"), ("header garbled", "is corrupt")])
def test_a_broken_safetensors_file_is_named_before_any_worker(assets, tmp_path, how, said):
    if how == "truncated":
        broken = _model_with(assets, tmp_path, lambda p: os.truncate(p, os.path.getsize(p) - 1000))
    else:
        broken = _model_with(assets, tmp_path, lambda p: _zero_start(p, 8))
    out = tmp_path / "new" / "out"
    result, output = train(tmp_path, recipe(assets, out, model_name_or_path=os.path.dirname(broken)))
    one_error(result, output, f"{broken} {said}", "Download or save the model again")
    assert "Initializing" not in output
    assert not (tmp_path / "new").exists()


def test_convert_names_a_broken_safetensors_file_and_writes_nothing(assets, tmp_path):
    broken = _model_with(assets, tmp_path, lambda p: os.truncate(p, os.path.getsize(p) // 2))
    result, output = run(["llamafactory-mca", "convert", "--hf_path", os.path.dirname(broken), "--output_path",
                          str(tmp_path / "converted")])
    one_error(result, output, f"{broken} is truncated")
    assert sorted(os.listdir(tmp_path)) == ["model"]


# ---- a folder that does not exist is not a malformed hub id ------------------------------------------------------


@pytest.mark.parametrize("name", ["absolute", "./relative"])
def test_a_missing_model_folder_says_the_folder_does_not_exist(assets, tmp_path, name):
    value = str(tmp_path / "absent" / "model") if name == "absolute" else "./absent/model"
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=value))
    one_error(result, output, f"model_name_or_path={value!r}", f"the folder {tmp_path / 'absent' / 'model'} does "
              f"not exist (the nearest existing folder is {tmp_path})")
    assert "Repo id" not in output
    assert not (tmp_path / "out").exists()


def test_convert_of_a_missing_folder_names_the_flag(tmp_path):
    result, output = run(["llamafactory-mca", "convert", "--hf_path", "./missing", "--output_path", "out"],
                         cwd=tmp_path)
    one_error(result, output, "--hf_path='./missing'", f"the folder {tmp_path / 'missing'} does not exist")
    assert "Repo id" not in output and os.listdir(tmp_path) == []


def test_a_hub_id_says_where_it_was_looked_for(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    result, output = run(["llamafactory-mca", "convert", "--hf_path", "tiny-org/absent", "--output_path", "out"],
                         env=env, cwd=tmp_path)
    one_error(result, output, "--hf_path='tiny-org/absent'",
              f"neither a local folder ({tmp_path / 'tiny-org' / 'absent'} does not exist)",
              f"nor in the Hugging Face cache ({tmp_path / 'cache'})", "HF_HUB_OFFLINE=1 forbids downloading it")
    assert os.listdir(tmp_path) == []


# ---- output_dir: said where it is, and never left empty -----------------------------------------------------------


def test_a_recipe_without_output_dir_is_refused(assets, tmp_path):
    config = recipe(assets, tmp_path / "unused")
    del config["output_dir"]
    result, output = train(tmp_path, config)
    one_error(result, output, "output_dir is not set in", str(tmp_path / "trainer_output"),
              "output_dir: trainer_output to keep that folder")
    assert not (tmp_path / "trainer_output").exists()


def test_an_explicit_output_dir_passes_the_check():
    from llamafactory_mca.errors import UserError
    from llamafactory_mca.preflight import check_output_dir_given

    check_output_dir_given({"output_dir": "trainer_output"}, "x.yaml")
    check_output_dir_given(["--output_dir", "trainer_output"], "the command line")
    for recipe_ in ({"output_dir": None}, {}, ["--model_name_or_path", "m"]):
        with pytest.raises(UserError, match="output_dir is not set"):
            check_output_dir_given(recipe_, "x.yaml")


def _nan_model(assets, tmp_path) -> str:
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(assets["models"]["qwen3"], model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return str(model)


def test_a_run_failing_in_its_workers_removes_the_output_dir_it_created_and_keeps_a_users(assets, tmp_path):
    """NaN weights are found by the workers, after the launcher created output_dir (taking its lock)."""
    model = _nan_model(assets, tmp_path)
    created = tmp_path / "saves" / "new" / "out"
    result, output = train(tmp_path, recipe(assets, created, model_name_or_path=model), name="created")
    one_error(result, output, "holds NaN or inf values")
    assert not (tmp_path / "saves").exists()

    mine = tmp_path / "mine"
    mine.mkdir()
    result, output = train(tmp_path, recipe(assets, mine, model_name_or_path=model), name="existing")
    one_error(result, output, "holds NaN or inf values")
    assert mine.is_dir() and os.listdir(mine) == []


# ---- a LoRA merge says which tokenizer files it wrote -------------------------------------------------------------


def test_a_lora_merge_names_the_tokenizer_files_it_wrote(assets, tmp_path):
    config = recipe(assets, tmp_path / "out", max_steps=1, save_strategy="steps", save_steps=1,
                    finetuning_type="lora", lora_rank=4, lora_target="all")
    result, output = train(tmp_path, config)
    ok(result, output)
    checkpoint = tmp_path / "out" / "checkpoint-1"
    for name, flags in (("adapter", []), ("merged", ["--merge_lora"])):
        target = tmp_path / name
        result, output = run(["llamafactory-mca", "merge", "--checkpoint_path", str(checkpoint), "--output_path",
                              str(target), *flags], timeout=300)
        assert result.returncode == 0, output[-4000:]
        last = [line for line in result.stdout.splitlines() if line.strip()][-1]  # stderr: a progress bar
        assert "no tokenizer files" not in last, last
        written = [n for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
                   if (target / n).is_file()]
        assert written and all(n in last for n in written), (last, sorted(os.listdir(target)))
    assert "LoRA adapter merged in" in last

