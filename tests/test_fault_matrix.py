"""The fault matrix, through the real commands: bad inputs, broken and missing files, killed processes. Each ends in
one line that names what is wrong (the key, the file, the rank) and what to do, printed once, last on screen, with no
traceback, and leaves nothing behind (or names the partial state it left).

Bad inputs that the launcher can judge stop before any worker starts, in seconds. For files:

A corrupt file of the right size is the case a size check cannot see: only reading it tells, and torch's own
errors (wrapped by its checkpoint loader, advising ``weights_only=False``) name no file. A missing folder must not be
reported as a malformed hub id, and a run that fails before training must not leave an empty output_dir. Where the
launcher can tell cheaply (safetensors headers, a checkpoint's metadata against its files, a missing output_dir),
the run stops before any worker starts, in seconds.
"""

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from llamafactory_mca.checkpoints import verify_checkpoint
from llamafactory_mca.errors import UserError
from tests._cli import cli_env, command_of, ok, one_error, ranks, recipe, run, start, train
from tests._dist import one_job_at_a_time


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


def _weight_item(checkpoint) -> tuple[str, int, int]:
    """The data file, offset and length of the stored embedding, a tensor every merge reads."""
    with open(os.path.join(_dist(checkpoint), ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "embedding.word_embeddings.weight")
    return os.path.join(_dist(checkpoint), info.relative_path), info.offset, info.length


def _flip(path: str, offset: int, count: int = 64) -> None:
    """``count`` bytes inverted in place: values change, every structure and the size stay."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _no_torch_advice(output: str) -> None:
    for text in TORCH_ADVICE:
        assert text not in output, output[-4000:]


def _break(checkpoint, what: str) -> str:
    """Break one file of ``checkpoint`` keeping its size; returns the file's path."""
    if what == "data, middle garbled":
        path = _data_file(checkpoint)
        _garble_middle(path)
    elif what == "data, a weight's first 4 KiB zeroed":
        path, offset, _ = _weight_item(checkpoint)
        _zero_start(path, offset)
    elif what == "data, 64 bytes inside a weight flipped":
        path, offset, length = _weight_item(checkpoint)
        _flip(path, offset + length // 2)
    elif what == "common.pt garbled":
        path = os.path.join(_dist(checkpoint), "common.pt")
        _garble_all(path)
    else:  # ".metadata garbled"
        path = os.path.join(_dist(checkpoint), ".metadata")
        _garble_all(path)
    return path


BREAKS = ("data, middle garbled", "data, a weight's first 4 KiB zeroed", "data, 64 bytes inside a weight flipped",
          "common.pt garbled", ".metadata garbled")


# ---- a corrupt checkpoint of full size: merge, resume, model_name_or_path ------------------------------------------


@pytest.mark.parametrize("what", BREAKS)
def test_merge_of_a_corrupt_checkpoint_names_the_file_and_leaves_nothing(checkpoints, tmp_path, what):
    source, _ = checkpoints
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(source / "checkpoint-4", checkpoint)
    broken = _break(checkpoint, what)
    command = [sys.executable, MERGE] if what.startswith("common") else ["llamafactory-mca", "merge"]
    result, output = run([*command, "--checkpoint_path", str(checkpoint), "--output_path", str(tmp_path / "hf")],
                         alone=False)
    one_error(result, output, broken, "corrupt")
    _no_torch_advice(output)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]  # no output folder, no temporary one


@pytest.mark.parametrize("what", ["data, whole file's first 4 KiB zeroed", "data, 64 bytes inside a weight flipped",
                                  "common.pt garbled", ".metadata garbled"])
def test_resume_from_a_corrupt_checkpoint_names_the_file_and_the_one_to_use(checkpoints, tmp_path, what):
    """Found by the launcher before any worker starts: the files against their checksums (the metadata's structure
    first)."""
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


def test_flipped_bytes_in_a_checkpoint_or_an_export_as_model_name_or_path_are_named_before_any_worker(
        checkpoints, assets, tmp_path):
    """64 bytes inside a tensor, the size kept: every structure parses, only the checksums written with the folder
    tell. Our checkpoint, and the Hugging Face weights the run exported into its output_dir."""
    source, _ = checkpoints
    model = tmp_path / "model"
    shutil.copytree(source / "checkpoint-4", model)
    broken = _break(model, "data, 64 bytes inside a weight flipped")
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=str(model)), alone=False)
    one_error(result, output, broken, "is corrupt")
    assert "Initializing" not in output and not (tmp_path / "out").exists()
    exported = tmp_path / "exported"
    os.makedirs(exported)
    for name in os.listdir(source):
        if os.path.isfile(source / name) and not name.startswith(("trainer_", "all_results", "train_results")):
            shutil.copy(source / name, exported / name)
    weights = exported / "model.safetensors"
    _flip(str(weights), os.path.getsize(weights) // 2)
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=str(exported)), alone=False)
    one_error(result, output, str(weights), "is corrupt")


def test_verify_checks_an_output_dir_and_names_a_corrupt_file_and_old_checkpoints_say_they_cannot_be(checkpoints,
                                                                                                      tmp_path):
    source, _ = checkpoints
    out = tmp_path / "out"
    shutil.copytree(source, out)
    result, output = run(["llamafactory-mca", "verify", str(out)], alone=False)
    assert result.returncode == 0, output
    for folder in (out / "checkpoint-2", out / "checkpoint-4", out):
        assert f"{folder}: " in output and "matches its xxh3_128 checksum" in output, output
    broken = _break(out / "checkpoint-2", "data, 64 bytes inside a weight flipped")
    result, output = run(["llamafactory-mca", "verify", str(out)], alone=False)
    one_error(result, output, broken, "is corrupt")
    os.remove(out / "checkpoint-4" / "mca_manifest.json")  # as written before checksums: it still merges
    result, output = run(["llamafactory-mca", "merge", "--checkpoint_path", str(out / "checkpoint-4"),
                          "--output_path", str(tmp_path / "hf")], alone=False)
    assert result.returncode == 0, output
    assert output.count("has no mca_manifest.json (written before checkpoints carried checksums): its files cannot "
                        "be verified") == 1, output


def test_a_truncated_checkpoint_as_model_name_or_path_is_refused_before_any_worker(checkpoints, assets, tmp_path):
    source, _ = checkpoints
    model = tmp_path / "model"
    shutil.copytree(source / "checkpoint-4", model)
    broken = _data_file(model)
    os.truncate(broken, 100)
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=str(model)), alone=False)
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
    result, output = train(tmp_path, recipe(assets, out, model_name_or_path=os.path.dirname(broken)), alone=False)
    one_error(result, output, f"{broken} {said}", "Download or save the model again")
    assert "Initializing" not in output
    assert not (tmp_path / "new").exists()


def test_convert_names_a_broken_safetensors_file_and_writes_nothing(assets, tmp_path):
    broken = _model_with(assets, tmp_path, lambda p: os.truncate(p, os.path.getsize(p) // 2))
    result, output = run(["llamafactory-mca", "convert", "--hf_path", os.path.dirname(broken), "--output_path",
                          str(tmp_path / "converted")], alone=False)
    one_error(result, output, f"{broken} is truncated")
    assert sorted(os.listdir(tmp_path)) == ["model"]


# ---- a folder that does not exist is not a malformed hub id ------------------------------------------------------


@pytest.mark.parametrize("name", ["absolute", "./relative"])
def test_a_missing_model_folder_says_the_folder_does_not_exist(assets, tmp_path, name):
    value = str(tmp_path / "absent" / "model") if name == "absolute" else "./absent/model"
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=value), alone=False)
    one_error(result, output, f"model_name_or_path={value!r}", f"the folder {tmp_path / 'absent' / 'model'} does "
              f"not exist (the nearest existing folder is {tmp_path})")
    assert "Repo id" not in output
    assert not (tmp_path / "out").exists()


def test_convert_of_a_missing_folder_names_the_flag(tmp_path):
    result, output = run(["llamafactory-mca", "convert", "--hf_path", "./missing", "--output_path", "out"],
                         cwd=tmp_path, alone=False)
    one_error(result, output, "--hf_path='./missing'", f"the folder {tmp_path / 'missing'} does not exist")
    assert "Repo id" not in output and os.listdir(tmp_path) == []


def test_a_hub_id_says_where_it_was_looked_for(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    result, output = run(["llamafactory-mca", "convert", "--hf_path", "tiny-org/absent", "--output_path", "out"],
                         env=env, cwd=tmp_path, alone=False)
    one_error(result, output, "--hf_path='tiny-org/absent'",
              f"neither a local folder ({tmp_path / 'tiny-org' / 'absent'} does not exist)",
              f"nor in the Hugging Face cache ({tmp_path / 'cache'})", "HF_HUB_OFFLINE=1 forbids downloading it")
    assert os.listdir(tmp_path) == []


# ---- output_dir: said where it is, and never left empty -----------------------------------------------------------


def test_a_recipe_without_output_dir_is_refused(assets, tmp_path):
    config = recipe(assets, tmp_path / "unused")
    del config["output_dir"]
    result, output = train(tmp_path, config, alone=False)
    one_error(result, output, "output_dir is not set in", str(tmp_path / "trainer_output"),
              "output_dir: trainer_output to keep that folder")
    assert not (tmp_path / "trainer_output").exists()


def test_an_explicit_output_dir_passes_the_check():
    from llamafactory_mca.errors import UserError
    from llamafactory_mca.launch.preflight import check_output_dir_given

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
                              str(target), *flags], timeout=300, alone=False)
        assert result.returncode == 0, output[-4000:]
        last = [line for line in result.stdout.splitlines() if line.strip()][-1]  # stderr: a progress bar
        assert "no tokenizer files" not in last, last
        written = [n for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
                   if (target / n).is_file()]
        assert written and all(n in last for n in written), (last, sorted(os.listdir(target)))
    assert "LoRA adapter merged in" in last



# ---- truncated or wholly garbled checkpoints -----------------------------------------------------------------

def test_a_resume_that_splits_the_checkpoints_steps_names_the_accumulation_that_keeps_its_global_batch(checkpoints,
                                                                                                     tmp_path):
    source, config = checkpoints
    out = tmp_path / "out"
    shutil.copytree(source, out)
    result, output = train(tmp_path, {**config, "output_dir": str(out), "overwrite_output_dir": False,
                                      "gradient_accumulation_steps": 3, "max_steps": 6})
    one_error(result, output, "dp 1 x gradient_accumulation_steps 3", "The checkpoint's steps took 4 micro-batches: "
              "gradient_accumulation_steps: 4 keeps its global batch at dp 1.")


def test_resume_from_a_truncated_checkpoint_names_the_file_and_the_one_to_use(checkpoints, tmp_path):
    source, config = checkpoints
    out = tmp_path / "out"
    shutil.copytree(source, out)
    broken = _data_file(out / "checkpoint-4")
    with open(broken, "r+b") as f:
        f.truncate(os.path.getsize(broken) // 2)
    # LLaMA-Factory resumes from the newest checkpoint by itself when output_dir is kept
    result, output = train(tmp_path, {**config, "output_dir": str(out), "overwrite_output_dir": False})
    one_error(result, output, f"{broken} is truncated", f"resume_from_checkpoint: {out / 'checkpoint-2'}")


def test_resume_from_a_wholly_garbled_data_file_names_the_checkpoint_and_the_one_to_use(checkpoints, tmp_path):
    source, config = checkpoints
    out = tmp_path / "out"
    shutil.copytree(source, out)
    broken = _data_file(out / "checkpoint-4")
    size = os.path.getsize(broken)
    with open(broken, "r+b") as f:  # same size, garbage inside: only reading it tells
        f.write(os.urandom(size))
    result, output = train(tmp_path, {**config, "output_dir": str(out), "overwrite_output_dir": False})
    # its checksum names it before any worker reads it
    one_error(result, output, f"cannot resume from {out / 'checkpoint-4'}", "is corrupt",
              f"resume_from_checkpoint: {out / 'checkpoint-2'}")


def test_merge_of_a_truncated_checkpoint_names_the_file_and_leaves_nothing(checkpoints, tmp_path):
    source, _ = checkpoints
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(source / "checkpoint-4", checkpoint)
    broken = _data_file(checkpoint)
    with open(broken, "r+b") as f:
        f.truncate(100)
    result, output = run([sys.executable, MERGE, "--checkpoint_path", str(checkpoint), "--output_path",
                           str(tmp_path / "hf")], alone=False)
    one_error(result, output, f"{broken} is truncated")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4"]  # no output folder, no temporary one


# ---- bad inputs, judged by the launcher before any worker starts ------------------------------------------------

def _moe(assets) -> dict:
    return {"model_name_or_path": assets["models"]["qwen3_moe"]}


# (name, recipe overrides (a callable of the assets where it needs them), processes, fragments of the one line)
BAD_INPUTS = [
    ("micro-batch 0", {"per_device_train_batch_size": 0}, 1, ["per_device_train_batch_size=0 must be a positive"]),
    ("accumulation 0", {"gradient_accumulation_steps": 0}, 1, ["gradient_accumulation_steps=0 must be a positive"]),
    ("negative lr", {"learning_rate": -1.0}, 1, ["learning_rate=-1.0 must not be negative"]),
    ("nothing to train", {"max_steps": -1, "num_train_epochs": 0}, 1, ["nothing to train"]),
    ("save_steps 0", {"save_strategy": "steps", "save_steps": 0}, 1, ["save_steps=0", "positive save_steps"]),
    ("cutoff_len 0", {"cutoff_len": 0}, 1, ["cutoff_len=0 must be a positive number of tokens"]),
    ("unknown template", {"template": "qwen3_nothinking"}, 1, ["template='qwen3_nothinking' is not one of",
                                                               "did you mean 'qwen3_nothink'"]),
    ("unknown dataset", {"dataset": "no_such_set"}, 1, ["dataset=no_such_set", "Undefined dataset"]),
    ("kto without tags", {"stage": "kto"}, 1, ["dataset 'tiny_alpaca' has no kto_tag column: stage kto trains on "
                                               "rows tagged desirable or not"]),
    ("unsupported dpo loss", lambda a: {"stage": "dpo", "pref_loss": "kto_pair", "dataset_dir": a["dpo"]}, 1,
     ["pref_loss='kto_pair' is not supported"]),
    ("streaming", {"streaming": True}, 1, ["streaming=True is not supported", "streaming: false"]),
    ("DoRA", {"finetuning_type": "lora", "use_dora": True}, 1, ["use_dora=True (DoRA) is not supported"]),
    ("unknown LoRA target", {"finetuning_type": "lora", "lora_target": "no_such_module"}, 1,
     ["lora_target ['no_such_module'] names modules", "q_proj"]),
    ("two precisions", {"bf16": True, "fp16": True}, 1, ["bf16=True and fp16=True: choose one precision"]),
    ("deepspeed", {"deepspeed": "ds_z3_config.json"}, 1, ["deepspeed='ds_z3_config.json' cannot be combined"]),
    ("recompute", {"recompute_granularity": "sometimes"}, 1, ["recompute_granularity='sometimes' is not one of"]),
    ("FP8 on a CPU", {"fp8": True}, 1, ["fp8='e4m3' needs GPUs with FP8 tensor cores", "no NVIDIA GPU", "Drop fp8"]),
    ("dispatcher", {"moe_token_dispatcher_type": "teleport"}, 1, ["moe_token_dispatcher_type='teleport'"]),
    ("VPP without PP", {"virtual_pipeline_model_parallel_size": 2}, 1,
     ["virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"]),
    ("PP beyond the world", {"pipeline_model_parallel_size": 3}, 2, ["= 3 does not divide the world size 2"]),
    ("CP beyond the world", {"context_parallel_size": 3}, 2, ["= 3 does not divide the world size 2"]),
    ("EP not dividing the experts", lambda a: {**_moe(a), "expert_model_parallel_size": 3}, 3,
     ["expert_model_parallel_size=3 does not divide num_experts"]),
    ("MoE under TP without SP", lambda a: {**_moe(a), "tensor_model_parallel_size": 2}, 2,
     ["tensor_model_parallel_size=2 on a model with experts needs sequence_parallel: true"]),
    ("resume from nowhere", {"resume_from_checkpoint": "/nonexistent/checkpoint-2"}, 1,
     ["resume_from_checkpoint='/nonexistent/checkpoint-2' is not a llamafactory_mca checkpoint"]),
]


@pytest.mark.parametrize("name,overrides,world,fragments", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_a_bad_input_is_one_line_before_any_worker(name, overrides, world, fragments, assets, tmp_path):
    overrides = overrides(assets) if callable(overrides) else overrides
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", **overrides), world=world, alone=False)
    one_error(result, output, *fragments)
    assert "Initializing" not in output  # LLaMA-Factory's launcher never got to start torchrun
    assert not (tmp_path / "out").exists()


def test_a_recipe_that_is_not_there_or_not_yaml_is_one_line(tmp_path):
    result, output = run(["llamafactory-cli", "train", str(tmp_path / "missing.yaml")], env=cli_env(1), alone=False)
    one_error(result, output, f"recipe '{tmp_path / 'missing.yaml'}' does not exist")
    (tmp_path / "broken.yaml").write_text("model_name_or_path: [unclosed\n")
    result, output = run(["llamafactory-cli", "train", str(tmp_path / "broken.yaml")], env=cli_env(1), alone=False)
    one_error(result, output, "cannot read", "broken.yaml")


def test_a_bad_process_count_is_one_line(assets, tmp_path):
    result, output = train(tmp_path, recipe(assets, tmp_path / "out"), world=None, env={"NPROC_PER_NODE": "two"},
                           alone=False)
    one_error(result, output, "NPROC_PER_NODE='two' must be a positive number of processes per node")


def test_more_processes_than_visible_gpus_is_refused_before_any_worker(monkeypatch):
    """On a 4-GPU host NPROC_PER_NODE=8 started 8 workers, each of which died with CUDA's "invalid device ordinal";
    the launcher counts the GPUs first (without GPUs, the processes are CPU processes, as many as asked)."""
    from llamafactory.extras import misc

    from llamafactory_mca.launch import preflight

    monkeypatch.setattr(misc, "get_device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("NPROC_PER_NODE", "8")
    with pytest.raises(UserError, match=r"NPROC_PER_NODE=8 asks for 8 processes on this node, and it has 4 GPUs "
                                        r"visible \(CUDA_VISIBLE_DEVICES=0,1,2,3\).*Set NPROC_PER_NODE=4 or fewer"):
        preflight.planned_world_size(1)
    monkeypatch.setenv("NPROC_PER_NODE", "4")
    assert preflight.planned_world_size(1) == 4
    monkeypatch.setattr(misc, "get_device_count", lambda: 0)
    monkeypatch.setenv("NPROC_PER_NODE", "8")
    assert preflight.planned_world_size(1) == 8


# ---- killed processes: nothing outlives a run --------------------------------------------------------------------

def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _family(pid: int) -> list:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _alive(processes: list) -> list:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _saved(out) -> bool:
    return out.is_dir() and any(n.startswith("checkpoint-") for n in os.listdir(out))


def test_a_rank_killed_with_sigkill_takes_everything_of_the_run_with_it(assets, tmp_path):
    """What the out-of-memory killer does, after a save (the checkpoint writer's results queue used to start a helper
    process per rank, which lived on, orphaned, at ~0.6 GB each)."""
    out = tmp_path / "out"
    config = recipe(assets, out, max_steps=100000, save_strategy="steps", save_steps=2, save_total_limit=1,
                    gradient_accumulation_steps=2, use_distributed_optimizer=True)
    with one_job_at_a_time():
        process, log = start(tmp_path, config, "run")
        try:
            assert _wait_for(lambda: _saved(out), 120), log.read_text()[-3000:]
            everything = _family(process.pid)
            assert len(ranks(process.pid)) == 2, [command_of(p) for p in everything]
            ranks(process.pid)[-1].kill()
            assert process.wait(timeout=120) != 0
            assert _wait_for(lambda: not _alive(everything), 30), [p.cmdline() for p in _alive(everything)]
        finally:
            for p in _alive(_family(process.pid)) if psutil.pid_exists(process.pid) else []:
                p.kill()
    output = log.read_text()
    one_error(subprocess.CompletedProcess([], 1), output, "training failed: rank 1 killed by SIGKILL",
              "Rank 0 was stopped with it", "A signal leaves no traceback")


def test_saves_leave_no_helper_and_a_writer_killed_mid_save_is_one_line_keeping_the_last_checkpoint(assets, tmp_path):
    """A worker forks its file writers only while it saves: between saves it has no child process a kill -9 could
    take from it mid-run, or that could outlive it (Megatron's default results queue started a helper per rank).
    A writer killed during a save (here rank 1's, at checkpoint-12) used to leave its rank waiting forever on
    Megatron's JoinableQueue: now the save fails on every rank at once, in one line naming the rank and the signal,
    the unfinished folder is removed and checkpoint-6 stays the one to resume from."""
    out = tmp_path / "out"
    config = recipe(assets, out, max_steps=12, save_strategy="steps", save_steps=6, gradient_accumulation_steps=2,
                    use_distributed_optimizer=True)
    with one_job_at_a_time():
        process, log = start(tmp_path, config, "run", env={"LLAMAFACTORY_MCA_FAULT": "writer:12@1"})
        assert _wait_for(lambda: _saved(out), 120), log.read_text()[-3000:]
        everything = _family(process.pid)
        workers = ranks(process.pid)
        assert len(workers) == 2 and _wait_for(lambda: not any(r.children() for r in workers), 30), \
            [command_of(c) for r in workers for c in r.children()]
        assert process.wait(timeout=180) != 0
        assert _wait_for(lambda: not _alive(everything), 30), [command_of(p) for p in _alive(everything)]
    one_error(subprocess.CompletedProcess([], 1), log.read_text(), "saving checkpoint-12 failed: rank 1's checkpoint "
              "writer", "killed by SIGKILL", "unfinished folder was removed", f"{out / 'checkpoint-6'} is the newest "
              "complete checkpoint")
    assert not any(n.startswith(("tmp-", "checkpoint-12")) for n in os.listdir(out)), os.listdir(out)
    verify_checkpoint(str(out / "checkpoint-6"))


STOPPED_BY_SIGINT = "[llamafactory_mca] error: stopped by SIGINT; the workers were stopped too."
# Sends SIGINT to this process once, at its first fork after torch's agent took SIGINT over. The hook is a builtin
# (no Python runs in it), so the signal is raised in the next fork hook that is Python's: logging's.
SIGINT_AT_THE_FIRST_FORK = """
import itertools, os, signal

_signal = signal.signal


def _arm_at_torchs_handler(signum, handler):
    if signum == signal.SIGINT and getattr(handler, "__name__", "") == "_terminate_process_handler":
        once = itertools.chain(map(os.kill, [os.getpid()], [signal.SIGINT]), itertools.repeat(None))
        os.register_at_fork(before=once.__next__)
    return _signal(signum, handler)


signal.signal = _arm_at_torchs_handler
"""


def test_ctrl_c_during_start_up_or_a_save_is_one_line_and_keeps_the_last_checkpoint(assets, tmp_path):
    """Ctrl-C reaches every process of the run at once (the terminal signals its process group): the launcher,
    torchrun, each rank and their file writers. During start-up (the launcher's imports, its checks, torchrun's
    imports, the ranks' set-up: wherever the keypress lands) it is one line. In the middle of writing checkpoint-8,
    the save is all or nothing (no checkpoint-8, no unfinished folder left), checkpoint-4 is intact, and the screen
    ends in one line."""
    for delay in (2, 9):
        with one_job_at_a_time():
            # steps enough that the keypress lands before the run ends, however quick the machine
            process, log = start(tmp_path, recipe(assets, tmp_path / f"early{delay}", max_steps=10_000),
                                  f"early{delay}")
            time.sleep(delay)
            os.killpg(process.pid, signal.SIGINT)
            assert process.wait(timeout=120) == 130, log.read_text()[-3000:]
        output = log.read_text()
        last = [line for line in output.splitlines() if line.strip()][-1]
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
        assert last.startswith("[llamafactory_mca] ") and ("SIGINT" in last or "interrupted" in last), output[-4000:]
    # the keypress that lands inside a fork hook of the launcher, where Python ignores exceptions, as it forks rank 0
    hook = tmp_path / "at_fork"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SIGINT_AT_THE_FIRST_FORK)
    with one_job_at_a_time():
        process, log = start(tmp_path, recipe(assets, tmp_path / "at_fork_run"), "at_fork",
                              env={"PYTHONPATH": str(hook)})
        everything = _family(process.pid)
        assert process.wait(timeout=120) == 130, log.read_text()[-3000:]
        assert _wait_for(lambda: not _alive(everything), 30), [command_of(p) for p in _alive(everything)]
    output = log.read_text()
    assert "Traceback" not in output and "Exception ignored" not in output, output[-4000:]
    assert output.rstrip().splitlines()[-1] == STOPPED_BY_SIGINT, output[-4000:]
    out = tmp_path / "out"
    config = recipe(assets, out, max_steps=8, save_strategy="steps", save_steps=4, gradient_accumulation_steps=2,
                    use_distributed_optimizer=True)
    with one_job_at_a_time():
        process, log = start(tmp_path, config, "run", env={"LLAMAFACTORY_MCA_FAULT": "interrupt:8"})
        assert _wait_for(lambda: _saved(out), 120), log.read_text()[-3000:]
        everything = _family(process.pid)
        assert process.wait(timeout=180) == 130, log.read_text()[-3000:]
        assert _wait_for(lambda: not _alive(everything), 30), [command_of(p) for p in _alive(everything)]
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    assert lines[-1] == STOPPED_BY_SIGINT, output[-4000:]
    assert output.count("SIGINT") == 1 and "interrupted" not in output, output[-4000:]
    assert sorted(n for n in os.listdir(out) if n.startswith(("checkpoint-", "tmp-"))) == ["checkpoint-4"], \
        os.listdir(out)
    verify_checkpoint(str(out / "checkpoint-4"))
