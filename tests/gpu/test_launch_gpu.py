"""The launcher on a CUDA machine: its ranks are forked from it with everything imported, not spawned to import it
all again (16-19 s of a GPU host's time to the first step), because it never initialises CUDA's driver.

Run: ``python -m pytest tests/gpu/test_launch_gpu.py -q`` (skipped without CUDA).
"""

import os
import subprocess
import sys

import pytest
import torch

from tests._cli import ok, recipe, train


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_driver_check_sees_what_initialises_cuda():
    """``cuda_driver_untouched`` turns False at the first plain is_available() (cuInit), and stays True through one
    that asks NVML, as a launcher's does."""
    code = ("import torch\nfrom llamafactory_mca.launch.torchrun import cuda_driver_untouched as untouched\n"
            "before = untouched()\ntorch.cuda.is_available()\nprint(before, untouched())")
    seen = {}
    for nvml in ("0", "1"):
        env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": nvml}
        seen[nvml] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    timeout=120).stdout.split()
    assert seen == {"0": ["True", "False"], "1": ["True", "True"]}


def test_the_launcher_forks_its_gpu_ranks(assets, tmp_path):
    """``USE_MCA=1 llamafactory-cli train`` on a GPU: the rank is forked from the launcher, and trains."""
    config = recipe(assets, tmp_path / "run", bf16=True, sequence_packing=True, max_steps=3)
    result, output = train(tmp_path, config, gpu=True, env={"LLAMAFACTORY_MCA_DEBUG": "1"})
    ok(result, output)
    assert "ranks forked from the launcher" in output, output[-3000:]
