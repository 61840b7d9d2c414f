"""The planner's memory prediction against measured peaks: every run of our path in ``benchmarks/results`` whose
workload this harness declares, predicted from its shape and layout alone. Writes ``planner_check.md`` (+ json).

    python benchmarks/planner_check.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_workloads import model_config, workloads  # noqa: E402

from llamafactory_mca.parallel import ParallelLayout  # noqa: E402
from llamafactory_mca.planner.memory import Training, estimate  # noqa: E402

KEYS = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp", "context_parallel_size": "cp",
        "expert_model_parallel_size": "ep", "virtual_pipeline_model_parallel_size": "vpp"}


def mca_config(kind: str, layers: int):
    """Our config of the workload's shape, as the bridge reads it (no weights)."""
    from transformers import AutoConfig as HfAutoConfig

    from llamafactory_mca.models.families import get_family

    shape = dict(model_config(kind, layers, smoke=False))
    hf = HfAutoConfig.for_model(shape.pop("model_type"), **shape)
    return get_family(hf.model_type).config_from_hf(hf)


def predict(config, workload, run, cutoff: int) -> dict:
    """The planner's estimate for one declared run of ours (``e2e_workloads.Run``) on ``config``."""
    extra = run.extra or {}
    sizes = {KEYS[k]: v for k, v in extra.items() if k in KEYS}
    tp, pp, cp, ep = (sizes.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    layout = ParallelLayout(world_size=run.gpus, tp=tp, pp=pp, vpp=sizes.get("vpp"), cp=cp, ep=ep, etp=1,
                            dp=run.gpus // (tp * pp * cp), expert_dp=run.gpus // (ep * pp),
                            micro_batch_size=run.micro_batch, grad_accum=run.grad_accum)
    modules = extra.get("recompute_modules")
    return estimate(config, layout, Training(
        tokens=cutoff, recompute=extra.get("recompute_granularity"),
        recompute_modules=tuple(modules.split(",")) if modules else ("core_attn",),
        sequence_parallel=bool(extra.get("sequence_parallel")), lora_rank=workload.tuning.get("lora_rank"),
        lora_experts="experts" in extra.get("lora_target", "")))


def rows() -> list[dict]:
    found = []
    declared = workloads(smoke=False)
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "*",
                                              "e2e*.json"))):
        with open(path) as f:
            data = json.load(f)
        for name, w in data.get("workloads", {}).items():
            spec = declared.get(name)
            if spec is None or spec.model not in ("dense", "moe"):
                continue
            for run_name, run in w.get("runs", {}).items():
                decl = next((r for r in spec.runs if r.name == run_name), None)
                if decl is None or decl.path != "ours" or not run.get("peak_memory_gib") or not decl.packing:
                    continue
                predicted = predict(mca_config(spec.model, w["settings"]["layers"]), spec, decl,
                                    w["settings"]["cutoff_len"])
                found.append({"results": os.path.relpath(path, os.path.dirname(os.path.abspath(__file__))),
                              "workload": name, "run": run_name, "layout": decl.layout,
                              "measured_gib": run["peak_memory_gib"], "predicted_gib": predicted["peak"],
                              "error": round(predicted["peak"] / run["peak_memory_gib"] - 1, 3),
                              "breakdown": predicted})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    found = rows()
    lines = ["| results | workload | run | layout | measured GiB | predicted GiB | error |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['results']} | {r['workload']} | {r['run']} | {r['layout']} | {r['measured_gib']:.1f} | "
              f"{r['predicted_gib']:.1f} | {r['error']:+.1%} |" for r in found]
    print("\n".join(lines))
    if args.out:
        with open(os.path.join(args.out, "planner_check.json"), "w") as f:
            json.dump(found, f, indent=2)
        with open(os.path.join(args.out, "planner_check.md"), "w") as f:
            f.write("# Planner: predicted vs measured peak memory per GPU\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
