"""A new user's first hour, through the real commands: the installed set works, help is quick, a mistake
is one message before any worker starts, hub ids resolve like LLaMA-Factory's default path, faults are named,
killed launchers take their workers with them, and nothing waits forever.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from tests._cli import cli_env, fake_hub_cache, losses, ok, one_error, ranks, recipe, run, start, train


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MERGE = os.path.join(ROOT, "scripts", "megatron_merge.py")


# ---- 1. install ------------------------------------------------------------------------------------------------


def test_installed_torch_set_agrees_with_itself_and_the_pins():
    from llamafactory_mca.launch.health import (
        TORCH_SET,
        _module_version,
        check_installation,
        pinned,
        torch_set_problems,
    )

    installed = {name: _module_version(name) for name in TORCH_SET}
    assert torch_set_problems(installed) == [], installed
    pins = pinned()
    for name in TORCH_SET:
        assert installed[name].split("+")[0] == pins[name], (name, installed, pins)
    assert check_installation() == []


def test_a_broken_torch_set_is_one_line_naming_packages_versions_and_fix():
    from llamafactory_mca.launch.health import torch_set_problems

    problems = torch_set_problems({"torch": "2.15.0+cu132", "torchvision": "0.29.2+cu132",
                                   "torchaudio": "2.11.0+cu130"})
    assert len(problems) == 1, problems
    line = problems[0]
    for fragment in ("torch 2.15.0+cu132", "torchaudio 2.11.0+cu130", "pip install torch==2.14.1 torchvision==0.29.1 "
                     "torchaudio==2.11.0"):
        assert fragment in line, line
    assert "\n" not in line


def test_version_command_reports_the_torch_set_and_succeeds():
    result, output = run(["llamafactory-mca", "version"])
    assert result.returncode == 0, output
    for name in ("llamafactory-mca", "llamafactory", "megatron-core", "torch", "torchvision", "torchaudio", "CUDA",
                 "transformer-engine", "flash-attn"):
        assert name in result.stdout
    assert "problem" not in output


# ---- 4. quiet, quick help ----------------------------------------------------------------------------------------


def test_train_help_is_quick_and_names_the_megatron_keys():
    result, output = run(["llamafactory-mca", "train", "--help"], alone=False)
    assert result.returncode == 0 and result.seconds < 5, output
    assert len(output.splitlines()) < 120
    for key in ("tensor_model_parallel_size", "expert_model_parallel_size", "sequence_packing", "max_nonfinite_steps"):
        assert key in output


def test_convert_and_merge_help_explain_every_flag():
    result, output = run(["llamafactory-mca", "convert", "--help"], alone=False)
    assert result.returncode == 0
    for flag in ("--tensor_model_parallel_size", "--pipeline_model_parallel_size", "--expert_model_parallel_size",
                 "--hf_path", "--output_path"):
        assert flag in output
    from llamafactory_mca.tools import flags

    for name, parser in flags.PARSERS.items():
        for action in parser()._actions:
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help text"
    # --help answers from the flags alone: no command imports torch for it
    code = ("import sys\nfrom llamafactory_mca.launch.cli import main\n"
            f"for command in {sorted(flags.PARSERS)}:\n    assert main([command, '--help']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    result, output = run([sys.executable, "-c", code], alone=False)
    assert result.returncode == 0 and output.count("usage: ") == len(flags.PARSERS), output


def test_version_flag_and_the_plan_commands_refusals(capsys):
    from importlib.metadata import version

    from llamafactory_mca.errors import UserError
    from llamafactory_mca.launch.plan_command import _options

    result, output = run(["llamafactory-mca", "--version"], alone=False)
    assert result.returncode == 0 and output.strip() == f"llamafactory-mca {version('llamafactory-mca')}", output
    result, output = run(["llamafactory-mca", "version", "--help"], alone=False)  # the help, not the check
    assert result.returncode == 0 and result.seconds < 5 and output.startswith("usage: llamafactory-mca version")
    from llamafactory_mca.tools.demo import demo_main

    with pytest.raises(SystemExit):
        demo_main(["--help"])
    said = capsys.readouterr().out
    assert "where the model" in said and "training steps" in said, said
    with pytest.raises(UserError, match=r"--gpu-memory -5: give each GPU's memory in GiB"):
        _options(["x.yaml", "--gpu-memory", "-5"])
    with pytest.raises(SystemExit):
        _options(["x.yaml", "--gpu", "2"])  # ambiguous: --gpus or --gpu-memory
    said = capsys.readouterr().err
    assert said.startswith("usage: llamafactory-mca plan RECIPE.yaml") and "usage: usage" not in said, said


def test_unknown_subcommand_says_so():
    result, output = run(["llamafactory-mca", "trian", "x.yaml"], alone=False)
    assert result.returncode == 2 and "unknown command 'trian' (did you mean 'train'?)" in output


def test_demo_is_quiet_and_answers_what_it_learned(tmp_path):
    result, output = run(["llamafactory-mca", "demo", "--output_dir", str(tmp_path / "demo")],
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, output[-4000:]
    lines = output.split("\n")  # as a terminal shows it: a progress bar's updates (\r) stay on one line
    assert len(lines) < 60, output
    assert "Traceback" not in output and "Warning" not in output and "warnings.warn" not in output, output
    assert "mixed precision" not in output, output  # LLaMA-Factory's bf16 advice: wrong on a CPU run
    assert "llamafactory_mca: training qwen3" in output and "step 40/40 | loss" in output
    answer = next(line for line in lines if line.startswith("A: "))
    assert answer == "A: The capital of France is Paris.", output


@pytest.mark.parametrize("gpu", [False, True])
def test_mixed_precision_advice_is_kept_on_gpus_only(gpu):
    """LLaMA-Factory's parser recommends bf16 on every run without it; a CPU run is fp32 on purpose, so there it is
    noise. Said through LLaMA-Factory's own logger in a process the USE_MCA=1 hook started."""
    code = (
        "import torch\n"
        f"torch.cuda.is_available = lambda: {gpu}\n"
        "from llamafactory.extras.logging import get_logger\n"
        "get_logger('llamafactory.hparams.parser').warning_rank0('We recommend enable mixed precision training.')\n"
        "get_logger('llamafactory.hparams.parser').warning_rank0('another warning stays')\n"
    )
    env = {**os.environ, "USE_MCA": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("LLAMAFACTORY_MCA_DISABLE", None)
    result, output = run([sys.executable, "-c", code], env=env)
    assert result.returncode == 0, output
    assert "another warning stays" in output
    assert ("We recommend enable mixed precision training." in output) == gpu, output


# ---- 3. one clear error, before any worker starts -------------------------------------------------------------


@pytest.mark.parametrize("overrides,fragments", [
    ({"lerning_rate": 1e-4}, ["unknown key", "'lerning_rate' (did you mean 'learning_rate'?)"]),
    ({"tensor_model_parallel_size": 3}, ["tensor_model_parallel_size=3 does not divide num_attention_heads=4",
                                         "sizes that fit this model: 1, 2"]),
    ({"stage": "ppo"}, ["stage='ppo' is not supported with USE_MCA=1; supported: pt, sft, dpo, kto, rm",
                        "for preference tuning without rollouts use stage: dpo"]),
    ({"predict_with_generate": True}, ["predict_with_generate is not supported with USE_MCA=1",
                                       "merge the checkpoint (llamafactory-mca merge)"]),
    ({"do_predict": True}, ["do_predict=True is not supported with USE_MCA=1", "Set do_predict: false"]),
    ({"finetuning_type": "qlora"}, ["finetuning_type='qlora' is not supported", "QLoRA is finetuning_type: lora"]),
    ({"expert_model_parallel_size": 2}, ["expert_model_parallel_size=2 on a dense model"]),
])
def test_a_mistake_is_one_message_before_any_worker(overrides, fragments, assets, tmp_path):
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", **overrides), world=None, alone=False)
    one_error(result, output, *fragments)
    assert "Initializing" not in output  # LLaMA-Factory's launcher never got to start torchrun
    assert result.seconds < 60
    assert not (tmp_path / "out").exists()


def test_debug_variable_shows_the_traceback(assets, tmp_path):
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", stage="ppo"),
                           env={"LLAMAFACTORY_MCA_DEBUG": "1"})
    assert result.returncode != 0 and "Traceback" in output and "UserError" in output


def test_llamafactory_demo_data_missing_says_where_it_lives(assets, tmp_path):
    config = recipe(assets, tmp_path / "out", dataset="identity,alpaca_en_demo", dataset_dir=str(tmp_path / "data"))
    result, output = train(tmp_path, config, alone=False)
    one_error(result, output, "identity, alpaca_en_demo are LLaMA-Factory's demo data",
              "set dataset_dir to LLaMA-Factory/data")


def test_a_dataset_file_that_is_not_there_is_named(assets, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "mine.json"}}))
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", dataset="mine", dataset_dir=str(data)),
                           alone=False)
    one_error(result, output, f"dataset 'mine': {data / 'mine.json'} does not exist")
    (data / "mine.json").write_text("[]\n")
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", dataset="mine", dataset_dir=str(data)),
                           alone=False)
    one_error(result, output, f"dataset 'mine': {data / 'mine.json'} holds no rows")
    # a name dataset_info.json does not have: the names it has, nearest first
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", dataset="tiny_alpacca"), alone=False)
    one_error(result, output, "dataset=tiny_alpacca", "It has: tiny_alpaca")
    # sft rows for dpo
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", stage="dpo"), alone=False)
    one_error(result, output, "dataset 'tiny_alpaca' is not a preference dataset", "stage: sft")


def test_layout_against_the_world_lists_what_works(assets, tmp_path):
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", tensor_model_parallel_size=2,
                                            pipeline_model_parallel_size=2), world=3, alone=False)
    one_error(result, output, "does not divide the world size 3 (NPROC_PER_NODE=3 x NNODES=1)")


# ---- 2. hub ids ---------------------------------------------------------------------------------------------------


def test_a_hub_id_in_the_cache_and_paths_with_spaces_train_offline_as_without_use_mca(assets, tmp_path):
    cache = tmp_path / "hub"
    fake_hub_cache(str(cache), "tiny-org/tiny-qwen3", assets["models"]["qwen3"])
    hub_env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    # one step over all 8 rows: both paths see the same batch, whatever order they shuffle in; ours with the rows
    # run without their padding (padding_free, the GPUs' default) against LLaMA-Factory's padded rows
    config = recipe(assets, tmp_path / "mca", model_name_or_path="tiny-org/tiny-qwen3", max_steps=1, max_samples=8,
                    per_device_train_batch_size=8, gradient_accumulation_steps=1)
    # a space in the recipe's path and in an override, which LLaMA-Factory's launcher used to split apart
    result, output = train(tmp_path, {**config, "padding_free": True}, env=hub_env, name="mca recipe",
                           args=(f"output_dir={tmp_path / 'mca run'}",))
    ok(result, output)
    assert "(rows without padding)" in output and "rows without padding, THD" in output
    default = {**config, "output_dir": str(tmp_path / "default")}
    (tmp_path / "default.yaml").write_text(yaml.safe_dump(default))
    env = {k: v for k, v in cli_env(None, hub_env).items() if k != "USE_MCA"}
    result, output = run(["llamafactory-cli", "train", str(tmp_path / "default.yaml")], env=env, timeout=300,
                          cwd=tmp_path)
    assert result.returncode == 0, output[-4000:]
    ours, theirs = losses(tmp_path / "mca run")[1], losses(tmp_path / "default")[1]
    assert ours == pytest.approx(theirs, rel=1e-4), (ours, theirs)


def test_a_missing_hub_id_offline_is_one_line(assets, tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path="tiny-org/missing"),
                           env=env, alone=False)
    one_error(result, output, "model_name_or_path='tiny-org/missing'", "HF_HUB_OFFLINE=1 forbids downloading it")


# ---- 5. faults -----------------------------------------------------------------------------------------------------


# (corrupt and truncated checkpoints, killed processes: tests/test_fault_matrix.py)


def test_nan_in_the_weights_names_the_tensor(assets, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(assets["models"]["qwen3"], model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    result, output = train(tmp_path, recipe(assets, tmp_path / "out", model_name_or_path=str(model)), world=2)
    one_error(result, output, "tensor 'model.layers.1.mlp.down_proj.weight'", "holds NaN or inf values")


def test_a_nan_step_is_skipped_and_counted_and_a_run_of_them_stops(assets, tmp_path):
    config = recipe(assets, tmp_path / "out", max_steps=3)
    result, output = train(tmp_path, config, env={"LLAMAFACTORY_MCA_FAULT": "nan:2"})
    ok(result, output, nonfinite=True)
    assert "step 2: inf/nan loss or gradients, step skipped (1 in a row; the run stops at 10)" in output
    assert "skipped 1 step(s) with inf/nan" in output
    curve = losses(tmp_path / "out")
    assert sorted(curve) == [1, 3] and all(math.isfinite(v) for v in curve.values()), curve

    config = recipe(assets, tmp_path / "out2", max_steps=5, max_nonfinite_steps=2)
    result, output = train(tmp_path, config, env={"LLAMAFACTORY_MCA_FAULT": "nan:2+"}, name="diverges")
    one_error(result, output, "steps 2-3 all had inf/nan loss or gradients (max_nonfinite_steps=2)")


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    return ranks(launcher.pid)


def test_killed_launchers_stop_their_workers_and_one_live_run_per_output_dir(assets, tmp_path):
    out = tmp_path / "out"
    config = recipe(assets, out, max_steps=100000, gradient_accumulation_steps=2)
    first, first_log = start(tmp_path, config, "first")
    launcher = psutil.Process(first.pid)
    try:
        _wait_for(lambda: len(_workers(launcher)) == 2 and (out / "trainer_log.jsonl").exists(), 120, "training")
        workers = _workers(launcher)
        # a second run on the same output_dir is refused, naming the live one
        result, output = train(tmp_path, config, world=2, name="second")
        one_error(result, output, f"output_dir='{out}' is in use by another run: pid {first.pid}")
        # the launcher stopped (kill's SIGTERM): torch's agent in it stops the workers, it lets go of its lock
        launcher.terminate()
        _wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 30,
                  "the workers to stop")
        assert first.wait(timeout=30) == 128 + signal.SIGTERM
        assert first_log.read_text().strip().splitlines()[-1] == \
            "[llamafactory_mca] error: stopped by SIGTERM; the workers were stopped too."
        assert not (out / ".llamafactory_mca.lock").exists()
    finally:
        for p in [launcher, *launcher.children(recursive=True)] if launcher.is_running() else []:
            p.kill()

    # the launcher killed outright: its workers see it gone and stop; its lock stays behind, stale
    third, _ = start(tmp_path, config, "third")
    launcher = psutil.Process(third.pid)
    _wait_for(lambda: len(_workers(launcher)) == 2, 120, "workers")
    workers = _workers(launcher)
    launcher.kill()
    third.wait(timeout=30)
    _wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 60,
              "the workers to stop")
    assert (out / ".llamafactory_mca.lock").exists()
    result, output = train(tmp_path, {**config, "max_steps": 1}, world=2, name="fourth")
    ok(result, output)
    assert f"taking over the stale lock {out / '.llamafactory_mca.lock'} (of pid {third.pid}" in output


def test_a_worker_whose_launcher_died_before_its_watchdog_started_stops():
    """The launcher killed while a worker still starts up: the worker has a new parent already when its watchdog
    starts, and must not take that one for its launcher (it would wait for the dead launcher's store forever)."""
    code = "import time; from llamafactory_mca import watchdog; watchdog.start(600, 0); time.sleep(60)"
    gone = subprocess.Popen(["true"])
    gone.wait()
    env = {**os.environ, "LLAMAFACTORY_MCA_LAUNCHER_PID": str(gone.pid), "LOCAL_RANK": "0"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30, result
    assert f"the launcher (pid {gone.pid}) is gone: stopping its workers." in result.stderr


# ---- 6. no silent hangs -------------------------------------------------------------------------------------------


def test_a_collective_waiting_past_ddp_timeout_aborts_naming_rank_step_and_call(assets, tmp_path):
    config = recipe(assets, tmp_path / "out", max_steps=4, gradient_accumulation_steps=2, ddp_timeout=5)
    result, output = train(tmp_path, config, world=2, env={"LLAMAFACTORY_MCA_FAULT": "hang:2@1"})
    message = one_error(result, output, "rank 0 (step 2) waited", "longer than ddp_timeout=5 s",
                        "rank 1 (step 1) is not in a collective: it stands at faults.py")  # the rank that stopped
    assert "called from" in message, message
    assert result.seconds < 120


def test_a_command_that_times_out_in_a_test_shows_its_workers_stacks():
    """A hang seen once in CI is found from its log: the test harness asks a timed-out command's processes for their
    stacks (SIGUSR1, which every worker's faulthandler answers) before it kills them, and fails with them."""
    code = "import time; from llamafactory_mca import watchdog; watchdog.start(600, 0); time.sleep(300)"
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run(["bash", "-c", f'{sys.executable} -c "{code}"; true'], timeout=30, alone=False)  # python: a child
    message = str(failed.value)
    assert "timed out after 30 s" in message and 'File "<string>", line 1 in <module>' in message, message
    assert "[process 1] Current thread" in message, message  # numbered, one process's stacks after another
    assert time.monotonic() - started < 55


def test_the_known_pipeline_hang_trains(assets, tmp_path):
    """Two identical short rows, PP2 x VPP2, two micro-batches of one row, one step: it used to wait forever."""
    from llamafactory_mca.tools.tiny import write_alpaca_dataset

    row = {"instruction": "Tell me something about cats please .", "input": "", "output": "Sure , cats ."}
    data = write_alpaca_dataset(str(tmp_path), 0, rows=[row, row])
    config = recipe(assets, tmp_path / "out", dataset_dir=data, pipeline_model_parallel_size=2,
                    virtual_pipeline_model_parallel_size=2, gradient_accumulation_steps=2,
                    per_device_train_batch_size=1, max_steps=1, ddp_timeout=60)
    result, output = train(tmp_path, config, world=2, timeout=180)
    ok(result, output)
    assert len(losses(tmp_path / "out")) == 1


def test_convert_refuses_a_bad_layout_before_starting_processes(assets, tmp_path):
    result, output = run(["llamafactory-mca", "convert", "--hf_path", assets["models"]["qwen3"], "--output_path",
                           str(tmp_path / "out"), "--tensor_model_parallel_size", "3"],
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, alone=False)
    one_error(result, output, "tensor_model_parallel_size=3 does not divide num_attention_heads=4")
    assert not (tmp_path / "out").exists()
