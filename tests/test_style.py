"""The code base stays at LLaMA-Factory's style bar: ruff (line length 119, pyflakes, pycodestyle, pyupgrade)."""

import os
import shutil
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    result = subprocess.run([ruff, "check", "llamafactory_mca", "scripts", "tests", "benchmarks"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_tests_import():
    """tests/gpu runs on a GPU machine only (README's test command leaves it out rather than skip it); on CPU it
    must still import and collect, so a rename in the package cannot break it unseen."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/gpu"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = int(result.stdout.strip().splitlines()[-1].split()[0])
    assert collected >= 15, result.stdout[-500:]
