"""LlamaBoard under USE_MCA=1 (launch/board.py): LLaMA-Factory's page without the variable, the Megatron group and our
checks with it, and the whole page driven in headless Chromium: a PP2 run of the demo's tiny model to its end, a
second one aborted.

The browser is Debian's chromium with its chromedriver, driven by Selenium; nothing downloads a browser build. Without
them the browser test fails and says what to install.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml
from selenium import webdriver
from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from llamafactory_mca.checkpoints import list_checkpoints, verify_checkpoint
from llamafactory_mca.launch.plugin import BOARD_MODULES
from llamafactory_mca.tools.demo import DATA_DIR, save_demo_model
from llamafactory_mca.tools.tiny import save_tiny_model
from tests._cli import cli_env, run
from tests._dist import free_port, one_job_at_a_time


pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

# Builds LlamaBoard's page in a process (without serving it) and runs what the Train tab's buttons run.
FORM = """
import json, sys
import gradio as gr
from llamafactory.webui.components import create_top, create_train_tab
from llamafactory.webui.engine import Engine
from llamafactory_mca.launch.board import describe

engine = Engine()
with gr.Blocks():
    engine.manager.add_elems("top", create_top())
    engine.manager.add_elems("train", create_train_tab(engine))
manager = engine.manager
data = {elem: getattr(elem, "value", None) for elem in manager.get_elem_list()}
for elem_id, value in json.loads(sys.argv[1]).items():
    data[manager.get_elem_by_id(elem_id)] = value
preview = next(engine.runner.preview_train(data))
args = engine.runner._parse_train_args(data)
plan_line, experts = describe(args)
hidden = [name for name in ("packing", "neat_packing", "ds_stage", "ds_offload", "mca_packing")
          if not manager.get_elem_by_id(f"train.{name}").visible]
print(json.dumps({"output_box": preview[manager.get_elem_by_id("train.output_box")], "args": args,
                  "plan_line": plan_line, "experts": experts, "hidden": hidden}, default=str))
"""


def _form(tmp_path, model, **values):
    base = {"top.lang": "en", "top.model_name": "Custom", "top.model_path": model, "top.finetuning_type": "full",
            "top.template": "qwen3_nothink", "train.dataset_dir": DATA_DIR, "train.dataset": ["demo_sft"],
            "train.output_dir": str(tmp_path / "out"), "train.compute_type": "fp32", "train.cutoff_len": 64}
    return {**base, **values}


def _page(tmp_path, form, use_mca=True):
    env = cli_env(None) if use_mca else {k: v for k, v in os.environ.items() if k != "USE_MCA"}
    result, output = run([sys.executable, "-c", FORM, json.dumps(form)], env=env, cwd=tmp_path, alone=False,
                         timeout=300)
    assert result.returncode == 0, output[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    return save_demo_model(str(tmp_path_factory.mktemp("board_model") / "tiny-qwen3"))


WHICH = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    found[name] = module.__loader__.__class__.__name__
from llamafactory.webui import components, control, locales, runner
found["create_train_tab"] = components.create_train_tab.__module__
found["_parse_train_args"] = runner.Runner._parse_train_args.__module__
found["list_checkpoints"] = control.list_checkpoints.__module__
found["megatron_labels"] = "mca_tab" in locales.LOCALES
print(json.dumps(found))
"""


def test_without_use_mca_the_page_is_llamafactorys():
    """Without USE_MCA the web UI's modules load as LLaMA-Factory ships them (its own loader, its own functions);
    with it, the five modules are adjusted."""
    plain = {k: v for k, v in os.environ.items() if k != "USE_MCA"}
    result, output = run([sys.executable, "-c", WHICH, *BOARD_MODULES], env=plain, alone=False)
    assert result.returncode == 0, output
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(found[name] == "SourceFileLoader" for name in BOARD_MODULES), found
    assert found["create_train_tab"] == "llamafactory.webui.components.train", found
    assert found["_parse_train_args"] == "llamafactory.webui.runner", found
    assert found["list_checkpoints"] == "llamafactory.webui.control", found
    assert found["megatron_labels"] is False

    result, output = run([sys.executable, "-c", WHICH, *BOARD_MODULES], env=cli_env(None), alone=False)
    assert result.returncode == 0, output
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(found[name] == "_PatchingLoader" for name in BOARD_MODULES), found
    assert {found[k] for k in ("create_train_tab", "_parse_train_args", "list_checkpoints")} == {
        "llamafactory_mca.launch.board"}, found
    assert found["megatron_labels"] is True


def test_the_form_becomes_our_recipe_and_is_refused_as_the_cli_refuses(tmp_path, demo_model):
    """The Megatron group's values are the recipe's keys and the preview names USE_MCA=1; a layout the model cannot
    take shows, in the output box, the very line the launcher prints for the same recipe."""
    page = _page(tmp_path, _form(tmp_path, demo_model, **{"train.mca_pp": 2}))
    args = page["args"]
    assert args["pipeline_model_parallel_size"] == 2 and args["tensor_model_parallel_size"] == 1
    assert args["sequence_packing"] is True and args["use_distributed_optimizer"] is True
    assert args["virtual_pipeline_model_parallel_size"] is None and args["recompute_granularity"] is None
    assert "USE_MCA=1 llamafactory-cli train" in page["output_box"]
    assert "--pipeline_model_parallel_size 2" in page["output_box"]
    # one packing switch, ours; LLaMA-Factory's and DeepSpeed's controls are hidden and write nothing
    assert page["hidden"] == ["packing", "neat_packing", "ds_stage", "ds_offload"], page["hidden"]
    assert "--sequence_packing True" in page["output_box"] and "--packing" not in page["output_box"]
    assert "deepspeed" not in args and "packing" not in args
    assert page["plan_line"].startswith("**world=2 tp=1 pp=2") and "predicted memory per GPU" in page["plan_line"]
    assert "global batch **16** = dp 1 × micro-batch 2 × accumulation 8" in page["plan_line"], page["plan_line"]
    assert page["experts"] is False  # the expert keys stay hidden for a dense model

    moe = save_tiny_model("qwen3_moe", str(tmp_path / "tiny-moe"))
    shutil.copytree(demo_model, moe, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors", "config.json",
                                                                                       "generation_config.json"))
    shown = _page(tmp_path, _form(tmp_path, moe, **{"train.mca_ep": 2}))
    assert shown["experts"] is True and " ep=2 " in shown["plan_line"], shown["plan_line"]

    refused = _page(tmp_path, _form(tmp_path, demo_model, **{"train.mca_tp": 3}))
    recipe = {k: v for k, v in refused["args"].items() if v is not None and v is not False and v != ""}
    path = tmp_path / "refused.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result, output = run(["llamafactory-cli", "train", str(path)], env=cli_env(None), cwd=tmp_path, alone=False)
    assert result.returncode == 1, output[-3000:]
    line = output.strip().splitlines()[-1]
    assert line.startswith("[llamafactory_mca] error: ") and "tensor_model_parallel_size=3" in line, line
    # the launcher's line, then what the keys it names are called on the page
    assert refused["output_box"] == line.removeprefix("[llamafactory_mca] error: ") + \
        ' (on this page: tensor_model_parallel_size is "Tensor parallel")', (refused["output_box"], line)


# ---- the page in a real browser ----------------------------------------------------------------------------------


def _browser(downloads: str):
    """Headless Chromium from Debian's packages; fails with what to install when it is missing."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.isfile(p)]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: the browser test needs Debian's chromium and chromedriver "
                    "(apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={downloads}", "--window-size=1600,2600"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def _wait(what: str, condition, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except StaleElementReferenceException:  # Gradio re-rendered what the condition held: look again
            value = None
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _start_board(root: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = cli_env(None, {"GRADIO_SERVER_PORT": str(port), "GRADIO_SERVER_NAME": "127.0.0.1",
                         "GRADIO_ANALYTICS_ENABLED": "False", "BROWSER": "true"})  # launch(inbrowser=True): no window
    log = open(root / "webui.log", "w")
    board = subprocess.Popen(["llamafactory-cli", "webui"], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)

    def up():
        assert board.poll() is None, (root / "webui.log").read_text()[-4000:]
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    _wait("llamafactory-cli webui to serve", up, 180)
    return board, port


class Page:
    """The few gestures the test needs on LlamaBoard's Gradio page."""

    def __init__(self, driver, shots: Path):
        self.driver, self.shots = driver, shots

    def find(self, xpath: str):
        return self.driver.find_element(By.XPATH, xpath)

    def _type(self, element, text: str, enter: bool = False):
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
        element.click()
        element.send_keys(Keys.CONTROL, "a")
        element.send_keys(text)  # replaces the selection: an emptied number field would be an event with no number
        if enter:
            element.send_keys(Keys.ENTER)
        element.send_keys(Keys.TAB)

    def textbox(self, label: str, text: str):
        self._type(self.find(f"//span[@data-testid='block-info' and normalize-space()='{label}']"
                             "/ancestor::label//textarea"), text)

    def dropdown(self, label: str, choice: str):
        element = self.find(f"//input[@aria-label='{label}']")
        self._type(element, choice, enter=True)
        _wait(f"{label} = {choice}", lambda: element.get_attribute("value") == choice, 10)

    def multiselect(self, label: str, choice: str):
        self._type(self.find(f"//span[@data-testid='block-info' and normalize-space()='{label}']"
                             "/ancestor::label//input"), choice, enter=True)

    def number(self, css: str, value: int):
        self._type(self.driver.find_element(By.CSS_SELECTOR, css), str(value), enter=True)

    def choose(self, label: str, choice: str):
        """Pick ``choice`` from the options the page lists (not typed in as a value of one's own)."""
        element = self.find(f"//input[@aria-label='{label}']")
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)

        def offered():
            """Open the list and look for the option; a list opened before the page refreshed its options keeps the
            old ones, so it is closed and opened again until the option is there."""
            element.click()
            try:
                return _wait(f"{choice} among the options of {label}", lambda: self.driver.find_elements(
                    By.XPATH, f"//ul[@role='listbox']/li[contains(normalize-space(), '{choice}')]"), 3)
            except AssertionError:
                element.send_keys(Keys.ESCAPE)
                self.driver.find_element(By.TAG_NAME, "body").click()
                return None

        def held() -> bool:
            """The choice stays for two seconds: an answer to the page's previous event (a form loaded for the
            option picked before) may still arrive and put the old value back, and then it is picked again."""
            try:
                _wait(f"{label} = {choice}", lambda: element.get_attribute("value") == choice, 10)
            except AssertionError:
                return False
            time.sleep(2)
            return element.get_attribute("value") == choice

        for _ in range(3):
            option = _wait(f"{choice} among the options of {label}", offered, 60, every=1)
            option[0].click()
            if held():
                return
        raise AssertionError(f"{label} did not keep {choice}: {element.get_attribute('value')}")

    def click(self, text: str, tab: bool = False):
        role = "@role='tab'" if tab else "not(@role='tab')"
        button = next(b for b in self.driver.find_elements(
            By.XPATH, f"//button[{role} and (normalize-space()='{text}' or span[normalize-space()='{text}'])]")
            if b.is_displayed())  # the tab bar's overflow menu holds hidden twins of the tabs
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
        try:
            button.click()
        except ElementClickInterceptedException:  # a dropdown's open list or a toast over it: click it as a script
            self.driver.execute_script("arguments[0].click();", button)

    def text(self) -> str:
        return self.driver.find_element(By.TAG_NAME, "body").text

    def values(self) -> str:
        """What the page's text fields hold (a Textbox's value is not the page's text)."""
        return self.driver.execute_script("return [...document.querySelectorAll('textarea')].map(t => t.value)"
                                          ".join('\\n')")

    def loss_plot(self) -> str | None:
        """The loss plot's image (a data URL), None before the first one."""
        # found and read in one script: the plot is re-rendered as the run logs, so a held element goes stale
        return self.driver.execute_script(
            "const x = document.evaluate(\"//*[@data-testid='block-label' and normalize-space()='Loss']"
            "/ancestor::div[contains(@class, 'block')][1]//img\", document, null, "
            "XPathResult.FIRST_ORDERED_NODE_TYPE, null).singleNodeValue; return x ? x.src : null;")

    def shot(self, name: str) -> Path:
        path = self.shots / f"{len(list(self.shots.iterdir())) + 1:02d}-{name}.png"
        self.driver.save_screenshot(str(path))
        print(f"screenshot: {path}")
        return path


def _run_processes(board: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(board.pid).children(recursive=True)


def test_llamaboard_trains_and_aborts_in_a_browser(tmp_path, record_property):
    """The demo's tiny model at PP2 from LlamaBoard in headless Chromium: preview, start, the loss plot grows, the run
    finishes with our checkpoint and Hugging Face weights; a second, longer run is aborted after its first checkpoint:
    no process of it is left and its newest checkpoint verifies. Screenshots of each stage: tmp_path/screenshots."""
    root = tmp_path / "board"
    shots = tmp_path / "screenshots"
    shots.mkdir()
    record_property("screenshots", str(shots))  # in the junit report; each file's path is printed as it is taken
    shutil.copytree(DATA_DIR, root / "data", ignore=shutil.ignore_patterns("*.yaml"))  # LlamaBoard's default data dir
    model = save_demo_model(str(root / "tiny-qwen3"))
    (root / "llamaboard_cache").mkdir()
    (root / "llamaboard_cache" / "user_config.yaml").write_text(yaml.safe_dump(
        {"lang": "en", "hub_name": "huggingface", "last_model": "Custom", "path_dict": {}, "cache_dir": None}))
    driver = None
    with one_job_at_a_time():  # the page starts two-process runs
        board, port = _start_board(root)
        try:
            driver = _browser(tempfile.mkdtemp(dir=tmp_path))
            page = Page(driver, shots)
            driver.get(f"http://127.0.0.1:{port}")
            _wait("the page", lambda: "Megatron (USE_MCA=1)" in page.text(), 60)
            _wait("the model name", lambda: page.find("//input[@aria-label='Model name']").get_attribute("value")
                  == "Custom", 30)
            page.textbox("Model path", model)
            page.dropdown("Finetuning method", "full")
            page.dropdown("Chat template", "qwen3_nothink")
            page.multiselect("Dataset", "demo_sft")
            page.dropdown("Compute type", "fp32")
            page.number("#mca_pp input[type=number]", 2)
            page.click("Extra configurations")
            extra = {"max_steps": 150, "logging_steps": 1, "save_steps": 75, "cutoff_len": 64,
                     "gradient_accumulation_steps": 2, "preprocessing_num_workers": 1, "learning_rate": 3e-3}
            page.textbox("Extra arguments", json.dumps(extra))
            _wait("the plan line", lambda: "pp=2" in page.text() and "predicted memory per GPU" in page.text(), 60)
            page.shot("form")

            page.click("Preview command")
            _wait("the preview", lambda: "USE_MCA=1 llamafactory-cli train" in page.text(), 60)
            assert "--pipeline_model_parallel_size 2" in page.text()
            page.shot("preview")

            output_dir = page.find("//input[@aria-label='Output dir']").get_attribute("value")
            first = root / "saves" / "Custom" / "full" / output_dir
            page.click("Start")
            plots = [_wait("the loss plot", page.loss_plot, 300)]
            page.shot("training")

            def finished():  # every plot the page shows on the way
                plot = page.loss_plot()
                if plot and plot != plots[-1]:
                    plots.append(plot)
                return "Finished." in page.text() and not _run_processes(board)

            _wait("the run to finish", finished, 300, every=0.2)
            page.shot("finished")
            assert len(plots) >= 2, "the loss plot did not change while the run trained"
            steps = [json.loads(line)["current_steps"] for line in (first / "trainer_log.jsonl").read_text().split(
                "\n") if line.strip()]
            assert steps[-1] == 150, steps
            assert [step for step, _ in list_checkpoints(str(first))] == [75, 150]
            verify_checkpoint(str(first / "checkpoint-150"))
            assert (first / "model.safetensors").is_file() and (first / "config.json").is_file()

            second_dir = "train_aborted"
            page.dropdown("Output dir", second_dir)
            page.textbox("Extra arguments", json.dumps({**extra, "max_steps": 4000, "save_steps": 5}))
            second = root / "saves" / "Custom" / "full" / second_dir
            page.click("Start")
            _wait("the second run's first checkpoint", lambda: list_checkpoints(str(second)), 300)
            running = _run_processes(board)
            assert len(running) >= 3, running  # llamafactory-cli (torch's agent runs in it), two ranks
            page.shot("second-run")
            page.click("Abort")
            _wait("the page to report the abort", lambda: "Aborted" in page.text() or "Finished." in page.text(), 60)
            gone, alive = psutil.wait_procs(running, timeout=60)
            assert not alive, [p.cmdline() for p in alive]
            assert not _run_processes(board)
            orphans = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                       if any(second_dir in part for part in p.info["cmdline"] or [])]
            assert not orphans, orphans  # nothing of the run left anywhere, re-parented or not
            _wait("the page to be ready again", lambda: "Finished." in page.text(), 60)
            page.shot("aborted")
            step, newest = list_checkpoints(str(second))[-1]
            verify_checkpoint(newest)
            print(f"aborted run: newest complete checkpoint {newest}")

            # resume: the output-dir list (refreshed as the choice changes) offers the aborted run; picking it loads
            # its form, and Start continues it from its newest checkpoint
            page.choose("Output dir", output_dir)
            page.choose("Output dir", second_dir)
            page.textbox("Extra arguments", json.dumps({**extra, "max_steps": step + 2, "save_steps": 100}))
            page.click("Start")
            _wait("the resumed run to finish", lambda: "Finished." in page.text() and not _run_processes(board)
                  and (second / "model.safetensors").is_file(), 300)
            logged = [json.loads(line)["current_steps"] for line in (second / "trainer_log.jsonl").read_text().split(
                "\n") if line.strip()]
            assert logged[-2:] == [step + 1, step + 2], logged
            assert [s for s, _ in list_checkpoints(str(second))][-1] == step + 2

            # export: the checkpoint list offers our checkpoints; Export merges one into Hugging Face weights
            chosen = str(Path("saves", "Custom", "full", output_dir, "checkpoint-150"))
            page.choose("Checkpoint path", chosen)
            page.click("Export", tab=True)
            exported = root / "exported"
            page.textbox("Export dir", str(exported))
            page.click("Export")
            _wait("the export", lambda: "Model exported." in page.values(), 120)
            page.shot("exported")
            assert (exported / "model.safetensors").is_file() and (exported / "config.json").is_file()
        except BaseException:
            if driver is not None:
                page.shot("failure")
            raise
        finally:
            if driver is not None:
                driver.quit()
            board.terminate()
            board.wait(30)


EXPORT = """
import json, sys
from llamafactory.webui.components.export import save_model

checkpoint, quantization = sys.argv[1:]
print(json.dumps(list(save_model("en", "Custom", "unused", "full", checkpoint, "default", 5, quantization, "", "cpu",
                                 False, "exported", "", "{}"))))
"""


def test_export_of_our_checkpoint_refuses_what_the_merge_cannot_do(tmp_path):
    """Export of one of our checkpoints is our merge, which writes Hugging Face weights only: a GPTQ quantization
    asked of it is refused in one line naming the field and the way to get it."""
    checkpoint = tmp_path / "run" / "checkpoint-2"
    (checkpoint / "dist_ckpt").mkdir(parents=True)
    (checkpoint / "mca_config.json").write_text("{}")
    (checkpoint / "dist_ckpt" / "metadata.json").write_text("{}")
    result, output = run([sys.executable, "-c", EXPORT, str(checkpoint), "4"], env=cli_env(None), cwd=tmp_path,
                         alone=False)
    assert result.returncode == 0, output[-3000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(said) == 1 and said[0].startswith(f"export_quantization_bit='4' with {checkpoint}"), said
    assert not (tmp_path / "exported").exists()
