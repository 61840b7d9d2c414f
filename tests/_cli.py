"""Running the real commands from tests: ``USE_MCA=1 llamafactory-cli train`` on a recipe, and reading its results.

Used by the training tests, the first-hour tests and ``benchmarks/scale_out.py``. ``make_assets`` builds what a
recipe needs without a download: tiny Qwen3 and Qwen3-MoE models, a tokenizer, sft / dpo / pt datasets.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import yaml

from llamafactory_mca.tools.tiny import alpaca_rows, save_tiny_model, save_tiny_tokenizer, write_alpaca_dataset
from tests._dist import one_job_at_a_time
from tests._reference import EAGER_REFERENCE


def command_of(process: psutil.Process) -> str:
    """A process's command line; empty for one that has exited since it was listed (a short-lived child, or a
    zombie its parent has not reaped yet)."""
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def ranks(launcher: int) -> list:
    """A run's workers: the children of its launcher (``llamafactory-cli train``, where torch's agent runs; the
    ranks are forked from it and share its command line, or spawned), not what they fork themselves."""
    try:
        return psutil.Process(launcher).children()
    except psutil.NoSuchProcess:
        return []


def make_assets(root: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer_dir = save_tiny_tokenizer(str(root / "tokenizer"))
    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir)) + 5  # not a multiple of 128: padding is exercised
    models = {}
    for name in ("qwen3", "qwen3_moe"):
        path = save_tiny_model(name, str(root / name), vocab_size=vocab)
        save_tiny_tokenizer(path)
        models[name] = path
    rows = alpaca_rows(48)
    rows += [{"instruction": "", "input": "", "output": ""}]  # empty: trained (its end token), counted, warned about
    rows += [{"instruction": " ".join(["Explain rain in one sentence ."] * 30), "input": "", "output": "Sure ."}]
    sft_dir = write_alpaca_dataset(str(root / "sft"), 0, rows=rows)
    dpo_dir = write_alpaca_dataset(str(root / "dpo"), 24, ranking=True)
    pt_dir = os.path.join(root, "pt")
    os.makedirs(pt_dir)
    texts = [{"text": r["instruction"] + " " + r["output"]} for r in alpaca_rows(40)]
    with open(os.path.join(pt_dir, "text.json"), "w") as f:
        json.dump(texts, f)
    with open(os.path.join(pt_dir, "dataset_info.json"), "w") as f:
        json.dump({"tiny_text": {"file_name": "text.json", "columns": {"prompt": "text"}}}, f)
    return {"models": models, "sft": sft_dir, "dpo": dpo_dir, "pt": pt_dir, "vocab": vocab}


def recipe(assets, out, **overrides):
    base = dict(model_name_or_path=assets["models"]["qwen3"], stage="sft", do_train=True, finetuning_type="full",
                dataset="tiny_alpaca", dataset_dir=assets["sft"], template="qwen3_nothink", cutoff_len=64,
                output_dir=str(out), overwrite_output_dir=True, per_device_train_batch_size=2,
                gradient_accumulation_steps=4, max_steps=2, learning_rate=1.0e-3, lr_scheduler_type="constant",
                logging_steps=1, save_strategy="no", report_to="none", seed=42, disable_tqdm=True,
                preprocessing_num_workers=1)
    return {**base, **overrides}


# LLaMA-Factory's default path (``llamafactory-cli train`` without USE_MCA), with eager attention for the families
# whose reference it is (``EAGER_REFERENCE``). One process: LLaMA-Factory runs it in-process on CPU.
DEFAULT_PATH_EAGER = (
    "import sys\n"
    "from llamafactory.model import patcher\n"
    "from llamafactory.cli import main\n"
    "kernel_choice = patcher.configure_attn_implementation\n"
    "def eager_reference(config, model_args):\n"
    f"    if getattr(config, 'model_type', None) not in {EAGER_REFERENCE}:\n"
    "        return kernel_choice(config, model_args)\n"
    "    setattr(config, '_attn_implementation', 'eager')\n"
    "patcher.configure_attn_implementation = eager_reference\n"
    "sys.argv = ['llamafactory-cli', *sys.argv[1:]]\n"
    "main()\n"
)


def cli_env(world: int | None = 1, env: dict | None = None, gpu: bool = False) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("USE_MCA", "LLAMAFACTORY_MCA_FAULT", "NPROC_PER_NODE")}
    full["USE_MCA"] = "1"
    if world is not None:
        full["NPROC_PER_NODE"] = str(world)
    if not gpu:
        full.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    full.update(env or {})
    return full


def _recipe(tmp_path, config, name: str) -> tuple[Path, Path]:
    """``config`` written as ``tmp_path / f"{name}.yaml"``, and where its run's log goes (``{name}.log`` beside)."""
    path = Path(tmp_path) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, path.with_suffix(".log")


def train(tmp_path, config, world=1, env=None, name="run", gpu=False, timeout=300, args=(), alone=True):
    """``USE_MCA=1 llamafactory-cli train`` with ``world`` processes (CPU processes unless ``gpu``). ``alone=False``
    for a run the launcher refuses before any worker starts: one process, which need not wait its turn."""
    path, log = _recipe(tmp_path, config, name)
    with open(log, "w") as f:  # a file, not a pipe: a killed run's leftovers cannot hold it open
        try:
            result = _run_alone(["llamafactory-cli", "train", str(path), *args], env=cli_env(world, env, gpu),
                                stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=tmp_path, alone=alone)
        except AssertionError as timed_out:  # the output, stacks included, went to the log
            raise AssertionError(f"{timed_out}{condensed_stacks(log.read_text())[-15000:]}") from None
    return result, log.read_text()


def start(tmp_path, config, name: str, world: int = 2, env: dict | None = None, gpu: bool = False
          ) -> tuple[subprocess.Popen, Path]:
    """``USE_MCA=1 llamafactory-cli train`` started and left running, in a session of its own (for the tests that
    kill it or its ranks): the launcher's process and its log, ``tmp_path / f"{name}.log"``. The caller holds
    ``one_job_at_a_time`` where it must."""
    path, log = _recipe(tmp_path, config, name)
    with open(log, "w") as f:  # the launcher keeps its own copy of the file
        process = subprocess.Popen(["llamafactory-cli", "train", str(path)], env=cli_env(world, env, gpu), stdout=f,
                                   stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    return process, log


def run_default_path(tmp_path, config, name="default", command=("llamafactory-cli",)) -> Path:
    """The recipe through LLaMA-Factory's default path (``llamafactory-cli train`` without USE_MCA, one CPU process;
    ``sequence_packing`` is ours and left out): the run's folder, ``tmp_path / name``. ``command`` stands in for
    ``llamafactory-cli`` (``DEFAULT_PATH_EAGER``)."""
    tmp_path = Path(tmp_path)
    config = {k: v for k, v in config.items() if k != "sequence_packing"} | {"output_dir": str(tmp_path / name)}
    path, _ = _recipe(tmp_path, config, name)
    env = {k: v for k, v in cli_env(None).items() if k != "USE_MCA"}
    result, output = run([*command, "train", str(path)], env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, output[-4000:]
    return tmp_path / name


def default_path_losses(tmp_path, config, name="default", command=("llamafactory-cli",)) -> dict[int, float]:
    """Step -> loss of the recipe through LLaMA-Factory's default path (``run_default_path``)."""
    return losses(run_default_path(tmp_path, config, name, command))


def losses(output_dir) -> dict[int, float]:
    """Step -> loss from LLaMA-Factory's trainer_log.jsonl (the last entry wins after a resume)."""
    found = {}
    with open(os.path.join(output_dir, "trainer_log.jsonl")) as f:
        for line in f:
            entry = json.loads(line)
            if entry.get("loss") is not None:
                found[entry["current_steps"]] = entry["loss"]
    return found


def ok(result, output, nonfinite: bool = False):
    """The run succeeded, and (unless the test injects them) no step was skipped for inf/nan loss or gradients."""
    assert result.returncode == 0, output[-6000:]
    assert nonfinite or "inf/nan loss or gradients" not in output, output[-6000:]


def one_error(result, output: str, *fragments: str) -> str:
    """The run failed with one user error: printed once, last on screen, no traceback; returns the message."""
    assert result.returncode != 0, output[-4000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("[llamafactory_mca] error: "), output[-4000:]
    message = lines[-1]
    assert output.count(message) == 1, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def run(args, env=None, timeout=120, cwd=None, alone=True):
    """A command; ``alone=False`` for one that stays a single process (a merge, a refused recipe, --help)."""
    result = _run_alone(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd, alone=alone)
    return result, result.stdout + result.stderr


def _run_alone(args, alone: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` as the only multi-process job (``one_job_at_a_time``) unless not ``alone``;
    ``result.seconds``: the command's own time, not the wait for its turn."""
    count = (kwargs.get("env") or os.environ).get("NPROC_PER_NODE") or "1"
    processes = int(count) if count.isdigit() else None  # a test's deliberately bad value: as a large job
    timeout = kwargs.pop("timeout", None)
    with one_job_at_a_time(processes) if alone else contextlib.nullcontext():
        start = time.perf_counter()
        if kwargs.pop("capture_output", False):
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with subprocess.Popen(args, **kwargs) as process:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:  # say where the command stood: its output so far, every rank's stacks
                stdout, stderr = _stop_with_stacks(process)
                raise AssertionError(f"{' '.join(map(str, args))} timed out after {timeout} s; the end of its "
                                     f"output, with each process's stacks:\n{stdout[-3000:]}\n"
                                     f"{condensed_stacks(stderr)[-12000:]}") from None
        result = subprocess.CompletedProcess(args, process.returncode, stdout, stderr)
        result.seconds = time.perf_counter() - start
    return result


def _stop_with_stacks(process: subprocess.Popen) -> tuple[str, str]:
    """A hung command's processes asked for their stacks (SIGUSR1: the workers' faulthandler prints them; a process
    without a handler ends), then killed; all of its output."""
    family = [process.pid] + [child.pid for child in _descendants(process.pid)]
    for pid in family[1:]:  # one at a time: their stacks do not interleave
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
    time.sleep(2)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stdout, stderr = process.communicate()
    return _text(stdout), _text(stderr)


_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")


def condensed_stacks(text: str, frames: int = 8) -> str:
    """``text`` with each thread's stack (faulthandler's format) cut to its innermost ``frames`` frames and each
    process's stacks numbered: eight ranks' stacks then fit in the end of the output a failure shows."""
    lines, process, kept = [], 1, None
    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            lines.append(f"[process {process}] {line}")
            process += header.group(1) == "Current thread"
            kept = 0
        elif kept is not None and line.startswith("  File "):
            kept += 1
            if kept <= frames:
                lines.append(line)
            elif kept == frames + 1:
                lines.append("  ...")
        else:
            kept = None
            lines.append(line)
    return "\n".join(lines)


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def fake_hub_cache(root, repo: str, model_dir: str) -> str:
    """``models--org--name/snapshots/<hash>`` with the files and ``refs/main``, as huggingface_hub lays it out."""
    folder = os.path.join(root, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(folder, "snapshots", "0123456789abcdef0123456789abcdef01234567")
    shutil.copytree(model_dir, snapshot)
    os.makedirs(os.path.join(folder, "refs"))
    with open(os.path.join(folder, "refs", "main"), "w") as f:
        f.write(os.path.basename(snapshot))
    return snapshot
