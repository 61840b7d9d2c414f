"""Activation through the installed startup hook: USE_MCA=1 switches LLaMA-Factory to us, nothing else changes."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

from tests._cli import cli_env, losses, one_error, recipe, run, train


def _run(args, env_extra=None, timeout=300, cwd=None):
    env = {k: v for k, v in os.environ.items() if k not in ("USE_MCA", "LLAMAFACTORY_MCA_DISABLE")}
    env.update(env_extra or {})
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _python(code, env_extra=None):
    return _run([sys.executable, "-c", code], env_extra)


BAD = {
    "model_name_or_path": "unused", "stage": "sft", "do_train": True, "finetuning_type": "full",
    "dataset": "identity", "template": "qwen3_nothink",
    "use_distributed_optimizer": True, "overlap_param_gather": True,  # but no overlap_grad_reduce
}


@pytest.mark.parametrize("command", [["llamafactory-cli", "train"], ["llamafactory-mca", "train"]])
def test_invalid_recipe_fails_with_our_message(tmp_path, command):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump({**BAD, "output_dir": str(tmp_path / "out")}))
    env = {"USE_MCA": "1"} if command[0] == "llamafactory-cli" else {}
    result = _run([*command, str(recipe)], env, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "overlap_param_gather=True needs use_distributed_optimizer=True and overlap_grad_reduce=True" in output
    assert "Megatron-Core backend llamafactory_mca" in output
    assert not (tmp_path / "out").exists()


def test_use_mca_resolves_llamafactory_imports_to_us():
    code = (
        "from llamafactory.hparams import parser\n"
        "from llamafactory.hparams.training_args import TrainingArguments as LF\n"
        "import llamafactory.train.mca as mca, llamafactory_mca.training_args as a, llamafactory_mca.workflow as w\n"
        "assert parser._TRAIN_MCA_ARGS[2] is a.TrainingArguments, parser._TRAIN_MCA_ARGS\n"
        "assert issubclass(LF, a.Seq2SeqTrainingArguments)\n"
        "assert mca.run_sft is w.run_sft and mca.run_pt is w.run_pt and mca.run_dpo is w.run_dpo\n"
        "print('resolved')\n"
    )
    result = _python(code, {"USE_MCA": "1"})
    assert result.returncode == 0, result.stderr
    assert "resolved" in result.stdout


def test_megatrons_fused_functions_are_compiled_when_first_called():
    """Megatron decorates some forty functions with torch.compile as it imports, which imported torch's inductor in the
    launcher and every rank (seconds on a GPU host) though a dense run of ours calls none of them: under USE_MCA=1 a
    function is compiled at its first call (here with dynamo off, as on CPUs: the eager math)."""
    code = (
        "import sys, torch\n"
        "from megatron.core.fusions import fused_bias_swiglu as f\n"
        "before = 'torch._inductor.compile_fx' in sys.modules\n"
        "torch._dynamo.config.disable = True\n"
        "x = torch.randn(3, 8)\n"
        "a, b = x.chunk(2, -1)\n"
        "assert torch.equal(f.swiglu(x), torch.nn.functional.silu(a) * b)\n"
        "print(before, 'torch._inductor.compile_fx' in sys.modules)\n"
    )
    result = _python(code, {"USE_MCA": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["False", "True"], result.stdout + result.stderr


def test_llamafactorys_import_time_bf16_check_leaves_cuda_untouched():
    """LLaMA-Factory's extras/misc.py asks at import whether the GPU has bf16, which initialised CUDA in every launcher
    (so its ranks could not be forked): under USE_MCA=1 the answer comes from NVML's compute capability (faked here:
    an 8.0 GPU, as NVML would see it), torch's own check is back in place after the import, and CUDA untouched."""
    code = (
        "import torch\n"
        "from llamafactory_mca.launch import torchrun\n"
        "torchrun._nvml_compute_capability = lambda: (8, 0)\n"
        "torch.cuda.is_available = lambda: True\n"
        "real = torch.cuda.is_bf16_supported\n"
        "import llamafactory.extras.misc as misc\n"
        "print(misc._is_bf16_available, torch.cuda.is_bf16_supported is real, torch.cuda.is_initialized())\n"
    )
    result = _python(code, {"USE_MCA": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-3:] == ["True", "True", "False"], result.stdout + result.stderr


def test_a_forked_rank_waits_for_the_last_fork_before_it_connects(tmp_path, monkeypatch):
    """A rank forked while the launcher's store thread held glibc's resolver lock hung connecting to the store (one
    in a few 8-rank starts on a busy 2-core machine): no rank starts its script, which connects, before the launcher
    has forked the last one; a group restarted by torch's agent waits for its own ranks."""
    from llamafactory_mca.errors import STATUS_DIR_ENV
    from llamafactory_mca.launch import torchrun

    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    open(tmp_path / "forked-1", "w").close()  # a previous start's folder name, as a file: not looked at
    waiter = threading.Thread(target=torchrun._wait_for_all_forked)
    waiter.start()
    for rank in (0, 2):
        time.sleep(0.3)
        assert waiter.is_alive()
        (tmp_path / "forked-2").mkdir(exist_ok=True)
        (tmp_path / "forked-2" / str(rank)).touch()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and sorted(os.listdir(tmp_path / "forked-2")) == ["0", "1", "2"]


def test_a_rank_stopped_mid_print_leaves_no_half_line(tmp_path):
    """A rank's streams (``torchrun.whole_lines``), unbuffered as the tests and many launchers run Python: a line
    printed whole is in the log, one cut short by a kill is not there at all (the launcher's last line joined half a
    step line that way: seen once on CI)."""
    code = ("import os, signal, sys\nfrom llamafactory_mca.launch.torchrun import whole_lines\nwhole_lines()\n"
            "print('step 1 | loss 1.0')\nsys.stdout.write('step 2 | loss')\nsys.stderr.write('half')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    with open(tmp_path / "log", "w") as log:
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log,
                       stderr=subprocess.STDOUT, timeout=120)
    assert (tmp_path / "log").read_text() == "step 1 | loss 1.0\n"


def test_a_taken_rendezvous_port_is_replaced_unless_the_user_chose_it(tmp_path):
    """LLaMA-Factory's launcher picks a free port and lets it go before torchrun listens on it, and a run started at
    the same moment took it (EADDRINUSE, seen with parallel runs): the launcher tries a new one before any worker
    starts. A port the user set in MASTER_PORT is not changed behind their back: one line says it is taken."""
    script = tmp_path / "worker.py"
    script.write_text("import os\nprint('worker at', os.environ['MASTER_PORT'])\n")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        command = [sys.executable, "-m", "llamafactory_mca.launch.torchrun", "--nproc_per_node", "1",
                   "--master_port", port, str(script)]
        moved = _run(command, {"LLAMAFACTORY_MCA_SPAWN_RANKS": "1"})
        kept = _run(command, {"LLAMAFACTORY_MCA_SPAWN_RANKS": "1", "MASTER_PORT": port})
    assert moved.returncode == 0, moved.stderr
    assert "worker at" in moved.stdout and f"worker at {port}" not in moved.stdout
    assert kept.returncode == 1 and "Traceback" not in kept.stderr, kept.stderr
    assert kept.stderr.strip().splitlines()[-1] == (
        f"[llamafactory_mca] error: port {port} (MASTER_PORT) is in use by another process: set MASTER_PORT to a free "
        "port, or unset it on a single node and a free one is chosen.")


def test_without_use_mca_llamafactory_is_untouched(tmp_path):
    version = _run(["llamafactory-cli", "version"])
    assert version.returncode == 0 and "LLaMA Factory" in version.stdout
    assert "llamafactory_mca" not in version.stdout + version.stderr
    code = (
        "import importlib.util, sys\n"
        "from llamafactory.hparams.parser import get_train_args\n"
        "from llamafactory.hparams.training_args import TrainingArguments\n"
        "assert importlib.util.find_spec('mcore_adapter') is None\n"
        "base = dict(model_name_or_path='x', stage='sft', do_train=True, dataset='identity',\n"
        f"            output_dir={str(tmp_path)!r})\n"
        "try:\n"
        "    get_train_args({**base, 'tensor_model_parallel_size': 2})\n"
        "except ValueError as err:\n"
        "    assert 'tensor_model_parallel_size' in str(err)\n"
        "    print('rejected')\n"
        "assert 'llamafactory_mca' not in sys.modules\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert "rejected" in result.stdout


def test_disable_switch_turns_the_hook_off():
    code = "import importlib.util, os; print(importlib.util.find_spec('mcore_adapter'), os.environ.get('USE_MCA'))"
    result = _python(code, {"USE_MCA": "1", "LLAMAFACTORY_MCA_DISABLE": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "None None"
    assert result.stderr.count("USE_MCA is removed from this process's environment") == 1, result.stderr


def test_disable_switch_trains_on_llamafactorys_default_path(assets, tmp_path):
    """The documented off switch (docs/install.md), as a user sets it beside USE_MCA=1: LLaMA-Factory's own trainer
    runs (before, its launcher asked torchrun for 0 processes on a CPU machine and its parser imported
    mcore_adapter)."""
    out = tmp_path / "out"
    result, output = train(tmp_path, recipe(assets, out, max_steps=1), world=None,
                           env={"LLAMAFACTORY_MCA_DISABLE": "1"})
    assert result.returncode == 0, output[-4000:]
    assert output.count("LLAMAFACTORY_MCA_DISABLE=1: USE_MCA is removed") == 1, output[-4000:]
    assert "Traceback" not in output and "Megatron-Core backend" not in output, output[-4000:]
    assert "llamafactory_mca: training" not in output  # our startup summary
    assert "Running training" in output  # the Hugging Face Trainer's banner: LLaMA-Factory's default path
    assert set(losses(out)) == {1}


@pytest.mark.parametrize("command", ["train", "demo"])
def test_our_commands_refuse_the_disable_switch_in_one_line(tmp_path, command):
    args = ["llamafactory-mca", command] + ([str(tmp_path / "x.yaml")] if command == "train" else [])
    env = {k: v for k, v in os.environ.items() if k != "USE_MCA"}
    result, output = run(args, env={**env, "LLAMAFACTORY_MCA_DISABLE": "1"}, cwd=tmp_path)
    one_error(result, output, "LLAMAFACTORY_MCA_DISABLE=1 turns the Megatron-Core backend off",
              f"`llamafactory-mca {command}` is that backend", "unset LLAMAFACTORY_MCA_DISABLE")


def test_another_upstream_version_is_one_line_naming_what_may_no_longer_hold(monkeypatch):
    """Every change we make to LLaMA-Factory, Megatron-Core and transformers is listed with the version it was
    written against, the versions CI pins; another installed version is named at start-up with the places that
    change it, and the pinned set says nothing."""
    import importlib.metadata
    import re

    from llamafactory_mca import compat

    with open(os.path.join(os.path.dirname(__file__), "..", "requirements", "stack.txt")) as f:
        pins = dict(re.findall(r"^([\w-]+)==([\w.]+)$", f.read(), re.M))
    assert {k: pins[k] for k in compat.WRITTEN_AGAINST} == compat.WRITTEN_AGAINST
    assert {package for package, _, _ in compat.UPSTREAM_CHANGES} == set(compat.WRITTEN_AGAINST)
    installed = dict(compat.WRITTEN_AGAINST)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed[name])
    assert compat.version_note() is None
    installed["megatron-core"] = "0.17.0"
    note = compat.version_note()
    assert note.startswith("[llamafactory_mca] note: megatron-core 0.17.0 (written against 0.16.1: compat.py (")
    assert "trainer/param_remainders.py (the distributed optimizer's Adam" in note and "llamafactory " not in note
    assert note.endswith("install the versions in requirements/stack.txt.") and "\n" not in note


# The launcher's preflight in one process, counting the request checks (plan.check_request) it makes.
_COUNT_REQUEST_CHECKS = ("import sys\n"
                         "from llamafactory_mca import plan\n"
                         "from llamafactory_mca.launch import preflight\n"
                         "real, calls = plan.check_request, []\n"
                         "plan.check_request = lambda *args: calls.append(args[0]) or real(*args)\n"
                         "preflight.check_recipe(preflight.read_recipe(sys.argv[1:]), sys.argv[1])\n"
                         "print('request checks:', len(calls))\n")


def test_the_request_is_checked_once_per_process(assets, tmp_path):
    """The parser's guard (plugin.py) checks the request as it is parsed; the plan made next does not check it
    again."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(assets, tmp_path / "out")))
    result, output = run([sys.executable, "-c", _COUNT_REQUEST_CHECKS, str(path)], env=cli_env(1), alone=False)
    assert result.returncode == 0, output[-3000:]
    assert "request checks: 1" in output, output[-3000:]
