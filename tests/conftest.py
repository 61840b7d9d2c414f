import os
import sys

import pytest


# Tests import the package from the checkout; make sure the venv's scripts (torchrun, llamafactory-cli) are found.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Tiny models, tokenizer and datasets for the tests that run the real commands (see tests/_cli.py)."""
    from tests._cli import make_assets

    return make_assets(tmp_path_factory.mktemp("assets"))
