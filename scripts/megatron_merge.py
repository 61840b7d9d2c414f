"""Megatron dist checkpoint (written by llamafactory_mca, any TP/PP/VPP/EP layout) → Hugging Face weights:
``llamafactory-mca merge`` under the name LLaMA-Factory users know.

    python scripts/megatron_merge.py --checkpoint_path saves/x/checkpoint-50 --output_path saves/hf --bf16

Runs on CPU in one plain process (no GPU, no torchrun) and streams tensor group by tensor group.
LLaMA-Factory's own merge flags (parallel sizes, --moe_grouped_gemm, --convert_model_max_length) are
accepted so existing commands keep working; the layout is read from the checkpoint.
"""

import sys

from llamafactory_mca.quiet import quiet_third_party
from llamafactory_mca.tools import flags


if __name__ == "__main__":
    flags.merge("megatron_merge.py").parse_args()  # --help and a wrong flag answer before the merge's imports
    quiet_third_party()  # before Megatron's import-time warnings
    from llamafactory_mca.tools.merge import main  # seconds of imports: after the flags are known good

    sys.exit(main(prog="megatron_merge.py"))
