import os
import sys

import pytest


# Tests import the package from the checkout; make sure the venv's scripts (torchrun, llamafactory-cli) are found.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# CI runs two pytest workers (pytest-xdist, --dist loadgroup). A file whose tests share one module- or session-long
# fixture (most run every case in one multi-process run) stays whole on one worker; the tests of these files are
# independent runs of the real command and spread over both workers, filling in behind the long files.
INDEPENDENT_TESTS = {"test_training.py", "test_tokens.py", "test_multimodal_training.py"}
# Handed out first: the longest single multi-process run (the layouts walk, minutes), so it does not finish last.
LONGEST_FIRST = ("test_layouts.py",)


def pytest_itemcollected(item):
    if item.path.name not in INDEPENDENT_TESTS:
        item.add_marker(pytest.mark.xdist_group(name=item.path.name))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # stable: the rest keep their order


def pytest_configure(config):
    # pytest 9 names items by a structured id and ignores the node ids pytest-xdist 3.8's loadgroup rewrites: every
    # worker then ran each file's shared multi-process fixture again (CI ran the layouts walk twice).
    if config.getoption("dist", "no") == "loadgroup" and pytest.version_tuple >= (9,):
        raise pytest.UsageError(f"pytest {pytest.__version__} breaks pytest-xdist's --dist loadgroup: install the "
                                "versions pinned in pyproject.toml (pip install -e '.[test]')")


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Tiny models, tokenizer and datasets for the tests that run the real commands (see tests/_cli.py)."""
    from tests._cli import make_assets

    return make_assets(tmp_path_factory.mktemp("assets"))


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def _no_process_group_in_the_pytest_process():
    """A test that initialises a process group in the pytest process itself leaves MASTER_PORT=29500 behind, and every
    later run of the real command from that worker then rendezvouses on that one port: with two workers, a run of the
    other worker's finds it taken (EADDRINUSE). Process groups belong in ``tests._dist.run_distributed``'s ranks."""
    before = {key: os.environ.get(key) for key in _RENDEZVOUS}
    yield
    leaked = {key: os.environ.get(key) for key in _RENDEZVOUS if os.environ.get(key) != before[key]}
    for key in leaked:
        if before[key] is None:
            os.environ.pop(key)
        else:
            os.environ[key] = before[key]
    assert not leaked, (f"this test set {leaked} in the pytest process (a process group initialised here?): run it "
                        "in tests._dist.run_distributed's ranks")
