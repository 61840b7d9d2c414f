"""What ``e2e_bench.py`` starts for our path in place of ``USE_MCA=1 llamafactory-cli train recipe.yaml``: the
launcher's preflight (every check, the output_dir lock) and our torchrun in this process, as ``llamafactory-cli``
runs them, with the bench's entry (``_e2e_entry.py``, given among torchrun's arguments) as the ranks' script instead
of LLaMA-Factory's launcher.py. Its first-step column then counts what a user's command waits for."""

import sys

from llamafactory_mca.launch import torchrun
from llamafactory_mca.launch.preflight import run_preflight


def main() -> int:
    argv = sys.argv[1:]  # torchrun's options, the entry, the recipe
    torchrun.keep_cuda_for_workers()  # as the startup hook does for llamafactory-cli train: the ranks can be forked
    run_preflight([argv[-1]])
    return torchrun.main(argv, in_launcher=True)


if __name__ == "__main__":
    sys.exit(main())
