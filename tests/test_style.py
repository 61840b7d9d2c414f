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
