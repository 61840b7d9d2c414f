"""End to end: LLaMA-Factory's default path vs llamafactory_mca on the same model, data, batch and steps.

Every run is a subprocess launched as LLaMA-Factory's launcher would (torchrun under ``USE_MCA=1`` or with more
than one GPU); ``_e2e_entry.py`` stands in for ``launcher.py`` to time steps and count real tokens. Results merge
into ``--out``/e2e.json and e2e.md, so one workload per invocation builds one table:

    python benchmarks/e2e_bench.py --workloads dense --out benchmarks/results
    python benchmarks/e2e_bench.py --smoke --workloads all          # tiny shapes on CPU: checks the harness

What runs is declared in ``e2e_workloads.py``, launched and measured by ``e2e_runner.py``, and judged and drawn by
``e2e_report.py``. See benchmarks/README.md for the workloads, the columns and the targets.
"""

from __future__ import annotations

import argparse
import os
import sys

from e2e_report import markdown, merge, write_results
from e2e_runner import machine_info, run_workload
from e2e_workloads import workloads


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the runner's llamafactory_mca is this checkout's, installed or not


def main(argv: list | None = None) -> None:
    names = list(workloads(False))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="dense", help=f"comma-separated: {','.join(names)} or all")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default 12; long, lora_dense 8; lora_moe 6), and one more "
                             "under torch.profiler for the GPU busy and launches/step columns")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps left out of the rates (default 4; long 3; lora_* 2)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default 28 for the dense model; MoE: 8 on >=120 GiB GPUs, else 4; "
                             "lora_moe 48, lora_dense 36: all)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--paths", default="lf,ours", help="which paths to run: lf,ours")
    parser.add_argument("--runs", default="", help="only these runs of the workloads, by name (default: all)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs available (default: all visible; smoke: 2)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per run before it is stopped")
    parser.add_argument("--loss-tol", type=float, default=0.05, help="relative gap allowed between final losses")
    parser.add_argument("--out", default=None, help="e2e.json + e2e.md merge here (default benchmarks/results; "
                                                   "smoke: benchmarks/results/smoke)")
    parser.add_argument("--work", default=os.path.join(ROOT, "benchmarks", "runs", "e2e"),
                        help="models, data and run logs (cached between invocations)")
    parser.add_argument("--ops", action="store_true",
                        help="the profiled step also records the host's ops, their input shapes and Python stacks: "
                             "ops_rank<N>.txt beside kernels_rank<N>.txt says which op launched which kernel time "
                             "(slows that step only, which no rate counts)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (gloo, fp32): checks the harness")
    parser.add_argument("--merge", nargs="+", default=None, metavar="E2E_JSON",
                        help="run nothing: merge these e2e.json files (later ones win) into --out, redraw the table")
    args = parser.parse_args(argv)
    if args.merge:
        args.out = args.out or os.path.join(ROOT, "benchmarks", "results")
        print(markdown(merge(args.merge, args.out, args.loss_tol)))
        return None
    chosen = names if args.workloads == "all" else [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {names}")
    if args.ops:  # read by the launched runs' _e2e_entry.py
        os.environ["E2E_BENCH_OPS"] = "1"
    args.paths = {p.strip() for p in args.paths.split(",") if p.strip()}
    args.runs = {r.strip() for r in args.runs.split(",") if r.strip()}
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", *(["smoke"] if args.smoke else []))
    info = machine_info(args.smoke)
    if not info["count"] and not args.smoke:
        parser.error("no CUDA GPU visible: the benchmark needs one (use --smoke to check the harness on CPU)")
    args.gpus = args.gpus or (2 if args.smoke else info["count"])
    specs = workloads(args.smoke)
    results = {}
    for name in chosen:
        def save(partial: dict, name: str = name) -> dict:
            return write_results(args.out, {name: partial}, args.loss_tol)

        results = save(run_workload(specs[name], args, info, save))
    print(markdown({"workloads": {n: results["workloads"][n] for n in chosen}}))
    print(f"[e2e] wrote {os.path.join(args.out, 'e2e.json')} and e2e.md")


if __name__ == "__main__":
    main()
