"""``report_to`` and ``use_swanlab``: Hugging Face's tracker callbacks, written by rank 0, through the real command.

One two-process run reports to every tracker whose package is installed here (CI installs tensorboard, wandb and
swanlab: the ``test`` extra; mlflow where it is installed), each to a local folder, and each must hold one run with
the scalars of ``trainer_state.json``'s log history, step by step (the loss also that of ``trainer_log.jsonl``),
and the run's arguments. A tracker whose package is missing is one line from the launcher.
"""

import importlib.util
import json
import os
import re
import sys
from types import SimpleNamespace

import pytest

from llamafactory_mca.errors import UserError
from llamafactory_mca.launch import preflight
from llamafactory_mca.trainer import reporting
from tests._cli import cli_env, losses, ok, one_error, recipe, run, train


pytestmark = pytest.mark.slow
TRACKERS = [name for name in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(name)]
SWANLAB = importlib.util.find_spec("swanlab") is not None
STEPS = 4


def _history(output_dir) -> dict[int, dict]:
    with open(os.path.join(output_dir, "trainer_state.json")) as f:
        return {e["step"]: e for e in json.load(f)["log_history"] if "loss" in e}


def _same(found: dict[int, dict], history: dict[int, dict], key_of) -> None:
    """Every scalar the trainer logged at every step, as the tracker holds it (``key_of``: the tracker's name)."""
    assert sorted(found) == sorted(history) == list(range(1, STEPS + 1)), (sorted(found), sorted(history))
    for step, logged in history.items():
        for key, value in logged.items():
            if key == "step" or not isinstance(value, (int, float)):
                continue
            assert found[step].get(key_of(key)) == pytest.approx(value, rel=1e-5), (step, key, found[step])


def _tensorboard(folder) -> tuple[dict[int, dict], str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {os.path.dirname(os.path.join(root, n)) for root, _, names in os.walk(folder) for n in names
            if n.startswith("events.out.tfevents")}
    assert len(runs) == 1, runs  # one writer: rank 0's
    events = EventAccumulator(runs.pop(), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    found: dict[int, dict] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            found.setdefault(event.step, {})[tag] = event.value
    args = events.Tensors("args/text_summary")[0].tensor_proto.string_val[0].decode()
    return found, args


def _wandb_records(path):
    """The records of a W&B run file (``run-<id>.wandb``: LevelDB's log format of protobuf ``Record``s, after a
    7-byte header), read as ``wandb sync`` reads them."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb(folder) -> tuple[dict[int, dict], dict]:
    files = [os.path.join(root, n) for root, _, names in os.walk(folder) for n in names if n.endswith(".wandb")]
    assert len(files) == 1, files
    found: dict[int, dict] = {}
    config: dict = {}
    for record in _wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            found[int(row["train/global_step"])] = row
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return found, config


def _mlflow(folder) -> tuple[dict[int, dict], dict]:
    runs = [os.path.join(root) for root, dirs, _ in os.walk(folder) if "metrics" in dirs]
    assert len(runs) == 1, runs
    found: dict[int, dict] = {}
    for name in os.listdir(os.path.join(runs[0], "metrics")):
        path = os.path.join(runs[0], "metrics", name)
        if os.path.isdir(path):  # a name with a slash: moe/load_balancing_loss
            for sub in os.listdir(path):
                _mlflow_metric(os.path.join(path, sub), f"{name}/{sub}", found)
        else:
            _mlflow_metric(path, name, found)
    params = {n: open(os.path.join(runs[0], "params", n)).read() for n in os.listdir(os.path.join(runs[0], "params"))}
    return found, params


def _mlflow_metric(path, name, found) -> None:
    for line in open(path):
        _, value, step = line.split()
        found.setdefault(int(step), {})[name] = float(value)


def _swanlab(folder) -> tuple[list[list[float]], str]:
    """Each logged series (SwanLab numbers its metrics' folders; their names are in its binary run file), step by
    step, and the run's config.yaml."""
    runs = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("run-")]
    assert len(runs) == 1, runs
    series = []
    for root, _, names in os.walk(os.path.join(runs[0], "logs")):
        for name in sorted(n for n in names if n.endswith(".log")):
            entries = [json.loads(line) for line in open(os.path.join(root, name))]
            series.append([e["data"] for e in sorted(entries, key=lambda e: e["index"])])
    return series, open(os.path.join(runs[0], "files", "config.yaml")).read()


@pytest.mark.skipif(not TRACKERS, reason="no tracker installed")
def test_every_installed_tracker_gets_the_logged_scalars_from_rank_0(assets, tmp_path):
    """Two processes (dp 2), a Qwen3-MoE model with a load-balancing loss (its aux loss is logged), four steps, a log
    line each: TensorBoard in logging_dir, W&B offline, MLflow's file store, SwanLab (LLaMA-Factory's use_swanlab,
    local mode). Each holds exactly one run (rank 1 wrote none) with every step's scalars as trainer_state.json's
    history has them, and the run's arguments."""
    out = tmp_path / "out"
    extra = dict(use_swanlab=True, swanlab_mode="local", swanlab_logdir=str(tmp_path / "swanlog"),
                 swanlab_project="mca") if SWANLAB else {}
    config = recipe(assets, out, model_name_or_path=assets["models"]["qwen3_moe"], max_steps=STEPS,
                    gradient_accumulation_steps=2, moe_aux_loss_coef=0.01, report_to=TRACKERS,
                    logging_dir=str(tmp_path / "tb"), run_name="mca-report", **extra)
    (tmp_path / "wandb").mkdir()
    env = dict(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"), WANDB_PROJECT="mca", WANDB_SILENT="true",
               MLFLOW_TRACKING_URI=f"file:{tmp_path / 'mlruns'}", MLFLOW_ALLOW_FILE_STORE="true")
    result, output = train(tmp_path, config, world=2, env=env)
    ok(result, output)
    history = _history(out)
    assert losses(out) == pytest.approx({step: e["loss"] for step, e in history.items()}, rel=1e-4)
    assert all("grad_norm" in e and "tokens_per_second_per_gpu" in e and "moe/load_balancing_loss" in e
               for e in history.values()), history

    if "tensorboard" in TRACKERS:
        assert not (out / "runs").exists()  # logging_dir, not the default under output_dir
        found, args = _tensorboard(tmp_path / "tb")
        _same(found, history, lambda key: f"train/{key}")
        assert json.loads(args)["run_name"] == "mca-report"
    if "wandb" in TRACKERS:
        found, config = _wandb(tmp_path / "wandb")
        _same(found, history, lambda key: f"train/{key}")
        assert config["learning_rate"] == 1e-3 and config["model_type"] == "qwen3_moe", config
        assert config["model/num_parameters"] > 0
    if "mlflow" in TRACKERS:
        found, params = _mlflow(tmp_path / "mlruns")
        _same(found, history, lambda key: key)
        assert params["learning_rate"] == "0.001" and params["model_type"] == "qwen3_moe", params
    if SWANLAB:
        series, config = _swanlab(tmp_path / "swanlog")
        for key in history[1]:
            if key != "step":
                wanted = [history[step][key] for step in range(1, STEPS + 1)]
                assert any(s == pytest.approx(wanted, rel=1e-5) for s in series), (key, wanted, series)
        assert "learning_rate:" in config and "model_type:" in config
        assert json.loads((out / "swanlab_public_config.json").read_text()) is not None  # LLaMA-Factory's extension


def test_a_tracker_without_its_package_is_one_line_before_any_worker(assets, tmp_path):
    """report_to naming a tracker that is not installed: the launcher's one line names the key, the value and the
    fix, and no worker starts (nothing is written to output_dir)."""
    if importlib.util.find_spec("clearml"):
        pytest.skip("clearml is installed here")
    config = recipe(assets, tmp_path / "out", report_to=["tensorboard", "clearml"] if TRACKERS else ["clearml"])
    result, output = train(tmp_path, config, world=2, alone=False)
    one_error(result, output, "report_to=clearml needs clearml, which is not installed: pip install clearml, or drop "
                              "clearml from report_to.")
    assert not (tmp_path / "out").exists()


def test_the_tracker_checks(monkeypatch):
    """Each refusal of ``check_reporting``, and what passes: nothing to report (the default), installed trackers."""
    installed = {"tensorboard", "wandb"}
    monkeypatch.setattr(reporting, "_found", lambda module: module in installed)
    monkeypatch.delenv("WANDB_WATCH", raising=False)
    monkeypatch.delenv("WANDB_LOG_MODEL", raising=False)

    def check(report_to, use_swanlab=False):
        preflight.check_reporting(SimpleNamespace(report_to=report_to), SimpleNamespace(use_swanlab=use_swanlab))

    check([])
    check(["tensorboard", "wandb"])
    for report_to, use_swanlab, message in (
            (["mlflow"], False, "report_to=mlflow needs mlflow, which is not installed: pip install mlflow, or drop "
                                "mlflow from report_to."),
            (["dagshub"], False, "report_to=dagshub needs dagshub mlflow, which is not installed: pip install "
                                 "dagshub mlflow"),
            (["tensorbord"], False, "report_to=tensorbord is not a tracker transformers knows: use tensorboard, "),
            ([], True, "use_swanlab=true needs swanlab, which is not installed: pip install swanlab, or set "
                       "use_swanlab: false.")):
        with pytest.raises(UserError, match=re.escape(message)):
            check(report_to, use_swanlab)
    monkeypatch.setenv("WANDB_LOG_MODEL", "end")
    with pytest.raises(UserError, match="WANDB_LOG_MODEL=end is not supported with USE_MCA=1"):
        check(["wandb"])


def test_a_recipe_without_report_to_reports_nowhere(assets, tmp_path):
    """LLaMA-Factory 0.9.5 and transformers 5.6 leave report_to at none: no tracker, so no package needed."""
    import yaml

    config = recipe(assets, tmp_path / "out")
    del config["report_to"]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(config))
    code = ("import sys\nfrom llamafactory_mca.launch import preflight\n"
            "from llamafactory_mca.trainer import reporting\n"
            "args = preflight.parse(preflight.read_recipe(sys.argv[1:]))[2]\n"
            "print('report_to', args.report_to, len(reporting.reporting_callbacks(args)))\n")
    result, output = run([sys.executable, "-c", code, str(tmp_path / "r.yaml")], env=cli_env(None), alone=False)
    assert result.returncode == 0 and "report_to [] 0" in output, output[-3000:]
