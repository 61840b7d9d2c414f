#!/usr/bin/env bash
# The GPU benchmarks as we ran them (one GPU, a pair, a host of four), phase by phase; each phase takes at most about
# 10 minutes. Scratch files (models, runs) go under $WORK (default: $TMPDIR or /tmp).
#   bash benchmarks/run_gpu.sh <phase> <out_dir>
# Single-GPU workloads run two at a time, one per GPU, to halve the wall time; two-GPU workloads run alone.
set -uo pipefail
phase=$1
out=${2:-benchmarks/results/gpu}
work=${WORK:-${TMPDIR:-/tmp}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bench() {  # bench <gpus> <name> <args...>
  local gpus=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus python3 benchmarks/e2e_bench.py --out "$out/$name" --work "$work/e2e_$name" \
    --steps 10 --warmup 3 --timeout 300 "$@" >> "$out/$name.log" 2>&1
  echo "== $name: exit $?"; tail -n 4 "$out/$name.log"
}
check_tests() {  # the GPU tests on the given GPUs
  CUDA_VISIBLE_DEVICES=$1 python3 -m pytest tests/gpu -q -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
  echo "== gpu tests: exit $?"; tail -n 3 "$out/gpu_tests.log"
}
check() {  # the trainer on GPUs end to end (DP2, distributed optimizer, merge, generate) and the GPU tests
  llamafactory-mca demo --output_dir "$work/demo" > "$out/demo.log" 2>&1; echo "== demo: exit $?"; tail -n 4 "$out/demo.log"
  check_tests 0,1
}
first_hour() {  # a new user's first hour on a GPU pair: the demo (and which processes hold GPU memory), a collective hung over NCCL
  (for _ in $(seq 1 90); do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; sleep 1; done \
    > "$out/gpu_apps.log" 2>&1) & local smi=$!
  llamafactory-mca demo --output_dir "$work/demo" > "$out/demo.log" 2>&1; echo "== demo: exit $?"; tail -n 6 "$out/demo.log"
  kill $smi 2>/dev/null; echo "== processes that held GPU memory during the demo (pid, memory):"; sort -u "$out/gpu_apps.log"
  llamafactory-mca version > "$out/version.log" 2>&1; echo "== version: exit $?"; cat "$out/version.log"
  first_hour_hang
}
first_hour_hang() {  # a rank stuck before step 3 over NCCL: the run stops after ddp_timeout, naming it
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "== one GPU: no NCCL hang test"; return; }
  [ -f "$work/demo/demo_sft.yaml" ] || llamafactory-mca demo --output_dir "$work/demo" > "$out/demo.log" 2>&1
  local start=$SECONDS
  LLAMAFACTORY_MCA_FAULT=hang:3@1 USE_MCA=1 llamafactory-cli train "$work/demo/demo_sft.yaml" output_dir="$work/hang" \
    ddp_timeout=20 max_steps=8 > "$out/hang.log" 2>&1
  echo "== hung collective over NCCL: exit $? after $((SECONDS - start)) s"; tail -n 3 "$out/hang.log"
}
multi_gpu() {  # benchmarks/multi_gpu.py's parts (PARTS, default the two-GPU ones)
  python3 benchmarks/multi_gpu.py --out "$out/multi_gpu" --work "$work/multi_gpu" --parts "${PARTS:-fidelity,resume,faults,paths}" \
    > "$out/multi_gpu.log" 2>&1; echo "== multi_gpu: exit $?"; grep -E "^(ok|FAIL)" "$out/multi_gpu.log" | cut -c1-300
}
gpu_gib() { nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1 | awk '{print int($1 / 1024)}'; }
case $phase in
  check) check ;;
  two_gpus) multi_gpu ;;  # fidelity (~6 min on 2 H100), then resume + faults (~8 min), then paths: PARTS=... per call
  node_moe)  # four GPUs: the MoE shape (12 layers) as LLaMA-Factory's ZeRO-3 runs it beside ours at EP4, with the
    # memory savers and at the planner's first proposal; then the node's faults and resumes (multi_gpu.py's node part).
    # DeepSpeed's wheel and hjson carried (see two_zero3)
    bench 0,1,2,3 n1 --workloads moe_node --runs "${RUNS:-lf_zero3,ours,ours_saving,ours_planned}" --gpus 4 --steps 8
    PARTS=node multi_gpu ;;
  node_dense)  # four GPUs: the Qwen3-8B shape, LLaMA-Factory's ZeRO-3 beside ours at TP2 x DP2, PP2 x VPP2 x DP2 and the
    # planner's first (DP4 and LLaMA-Factory's DDP where they can fit, >= 120 GiB); then the MoE pair again
    runs=lf_zero3,ours_tp2,ours_pp2,ours_planned; [ "$(gpu_gib)" -ge 120 ] && runs=$runs,ours,lf
    bench 0,1,2,3 n2 --workloads dense8b_node --runs "$runs" --gpus 4 --steps 8
    bench 0,1,2,3 n1b --workloads moe_node --runs lf_zero3,ours --gpus 4 --steps 8 ;;
  node_plan)  # four GPUs: half of the MoE recipe (24 layers) in the recipe's layout, the planner's 8-GPU proposal and
    # its first for this host, each against the planner's estimate (~8 min on 4 H200s)
    bench 0,1,2,3 n5 --workloads moe_recipe_node --gpus 4 --steps 8 ;;
  node_fixes)  # four GPUs: the rows that failed before their fixes (PP2 x VPP2 x DP2 of the 8B shape, the MoE memory
    # savers at EP4) beside LLaMA-Factory's ZeRO-3 and our EP4
    bench 0,1,2,3 n2 --workloads dense8b_node --runs "${DENSE:-ours_pp2}" --gpus 4 --steps 8
    bench 0,1,2,3 n1 --workloads moe_node --runs "${RUNS:-lf_zero3,ours,ours_saving}" --gpus 4 --steps 8 ;;
  node_faults) PARTS=node multi_gpu ;;  # four GPUs: multi_gpu.py's node part
  node_scale)  # four GPUs: 1 -> 2 -> 4 GPUs of the dense and MoE shapes at one global batch, 20 steps (curves against
    # one GPU's): one-GPU runs side by side, then the two-GPU ones, then the four-GPU layouts
    bench 0 n3a --workloads scale_dense --runs ours --gpus 1 --steps 20 --warmup 5 &
    bench 1 n4a --workloads scale_moe --runs ours --gpus 1 --steps 20 --warmup 5 & wait
    bench 0,1 n3b --workloads scale_dense --runs ours_dp2 --gpus 2 --steps 20 --warmup 5 &
    bench 2,3 n4b --workloads scale_moe --runs ours_ep2 --gpus 2 --steps 20 --warmup 5 & wait
    bench 0,1,2,3 n3 --workloads scale_dense --runs "${DENSE:-ours_dp4,ours_tp2_pp2,ours_cp4}" --gpus 4 --steps 20 --warmup 5
    bench 0,1,2,3 n4 --workloads scale_moe --runs "${MOE:-ours_ep4,ours_pp2_ep2}" --gpus 4 --steps 20 --warmup 5 ;;
  two_dense)  # two GPUs, dense: one GPU, DP2, TP2 + SP and PP2 of ours, LLaMA-Factory on one GPU and its DDP on two
    bench 0 g2 --workloads dense --runs lf,ours --gpus 1
    bench 0,1 g2 --workloads dp2,layouts --gpus 2 ;;
  two_moe_long)  # two GPUs: MoE on one GPU and EP2 (LLaMA-Factory's one GPU and DDP beside), then 32k at CP2
    bench 0 g2 --workloads moe --runs lf,ours --gpus 1
    bench 0,1 g2 --workloads moe_ep2 --gpus 2
    bench 0,1 g2 --workloads long --runs ours,ours_cp2 --gpus 2 --steps 8 ;;
  two_again)  # two GPUs: the headline ratio (DP2 against one GPU, ours) again, then the VL / LoRA paths and the hang
    bench 0 g2b --workloads dense --runs ours --gpus 1
    bench 0,1 g2b --workloads dp2 --runs ours --gpus 2
    PARTS=paths multi_gpu; first_hour_hang ;;
  two_profile)  # two GPUs: a dense step under the profiler on one GPU, at TP2 + SP and at PP2 (a report per rank)
    python3 benchmarks/profile_step.py --out "$out/profile" >> "$out/profile.log" 2>&1
    echo "== profile 1 GPU: exit $?"
    for layout in "--tp 2" "--pp 2"; do
      torchrun --nproc-per-node 2 benchmarks/profile_step.py $layout --out "$out/profile" >> "$out/profile.log" 2>&1
      echo "== profile $layout: exit $?"
    done
    grep -E "^(# One|- (step|GPU|MFU|per step))" "$out/profile.log" ;;
  two_profile_moe)  # two GPUs: an MoE step (8 layers) under the profiler at EP2 (a report per rank), then on one GPU
    torchrun --nproc-per-node 2 benchmarks/profile_step.py --moe --layers 8 --ep 2 --out "$out/profile" \
      >> "$out/profile.log" 2>&1; echo "== profile --moe --ep 2: exit $?"
    python3 benchmarks/profile_step.py --moe --layers 8 --out "$out/profile" >> "$out/profile.log" 2>&1
    echo "== profile --moe: exit $?"; grep -E "^(# One|- (step|GPU|MFU|per step))" "$out/profile.log" ;;
  graphs_check)  # one GPU: CUDA-graphed layers against eager ones (tests), and a dense step profiled both ways
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests/gpu/test_cuda_graphs_gpu.py -x -q -p no:cacheprovider \
      > "$out/graphs_tests.log" 2>&1; echo "== graphs tests: exit $?"; tail -n 30 "$out/graphs_tests.log"
    for on in "" "--on cuda_graphs"; do
      python3 benchmarks/profile_step.py $on --out "$out/profile" >> "$out/profile.log" 2>&1
      echo "== profile $on: exit $?"
    done
    grep -E "^(# One|- (step|GPU|MFU|per step))" "$out/profile.log"; tail -n 20 "$out/profile.log" ;;
  two_profile_dp)  # two GPUs: a dense step under the profiler on one GPU and at DP2, eager and with CUDA graphs
    for on in "" "--on cuda_graphs"; do
      python3 benchmarks/profile_step.py $on --out "$out/profile" >> "$out/profile.log" 2>&1
      echo "== profile 1 GPU $on: exit $?"
      torchrun --nproc-per-node 2 benchmarks/profile_step.py $on --out "$out/profile" >> "$out/profile.log" 2>&1
      echo "== profile DP2 $on: exit $?"
    done
    grep -E "^(# One|- (step|GPU|MFU|per step))" "$out/profile.log" ;;
  graphs)  # one GPU: dense and MoE, LLaMA-Factory beside ours eager and ours with CUDA graphs (results/h200_graphs)
    bench 0 g0 --workloads dense --runs lf,lf_liger,ours,ours_graphs,ours_graphs_fused --gpus 1
    bench 0 g0 --workloads moe --runs lf,ours,ours_graphs --gpus 1 ;;
  two_zero3)  # two GPUs: LLaMA-Factory's DeepSpeed ZeRO-3 on the MoE shape beside ours at EP2 (needs the deepspeed
    # wheel and its pure-Python deps carried: einops hjson msgpack ninja py-cpuinfo)
    bench 0,1 g2 --workloads moe_ep2 --runs lf_zero3,ours --gpus 2 --steps 8 ;;
  planner)  # one GPU: the planner against shapes it was not fitted on (dense at 14 layers, MoE at 4, each eager and
    # graphed) and 32k on one GPU; every run records the planner's prediction
    bench 0 planner_dense14 --workloads dense --runs ours,ours_graphs --gpus 1 --layers 14
    bench 0 planner_moe4 --workloads moe --runs ours,ours_graphs --gpus 1 --layers 4
    bench 0 planner_long --workloads long --runs ours --gpus 1 --steps 8 ;;
  planner_vl)  # one GPU: the Qwen2.5-VL-7B shape packed, with the planner's prediction
    bench 0 planner_vl --workloads vl --runs ours_pack --gpus 1 --steps 8 --warmup 3 ;;
  vl_prefetch)  # one GPU: the Qwen2.5-VL-7B shape, LLaMA-Factory padded, ours packed with and without collating
    # ahead (prefetch_steps); the run logs (startup times) kept beside the results
    bench 0 vl_prefetch --workloads vl --runs lf_nopack,ours_pack,ours_pack_inline --gpus 1 --steps 6 --warmup 2
    for r in lf_nopack ours_pack ours_pack_inline; do
      cp "$work/e2e_vl_prefetch/gpu/runs/vl/$r/log.txt" "$out/vl_prefetch/$r.log" 2>/dev/null
    done ;;
  first_hour) first_hour; check_tests 0,1 ;;
  single)  # check, then one GPU each: dense and MoE side by side
    check
    bench 0 g0 --workloads dense --gpus 1 & bench 1 g1 --workloads moe --gpus 1 & wait ;;
  varlen)
    bench 0 g0 --workloads varlen --gpus 1 ;;
  pair)  # two GPUs: layouts (1 GPU, TP2, PP2), DP2 and EP2 of our path
    bench 0,1 g2 --workloads layouts --gpus 2 --paths ours
    bench 0,1 g2 --workloads dp2,moe_ep2 --gpus 2 --paths ours ;;
  long)
    bench 0,1 g3 --workloads long --gpus 2 --steps 8 ;;
  moe_long)  # GPU 0: long on one GPU (LF, ours) | GPU 1: MoE of our path (as measured, and with recompute); then CP2
    bench 0 g3 --workloads long --runs lf,ours --steps 8 & bench 1 g1 --workloads moe --runs ours,ours_recompute & wait
    bench 0,1 g3 --workloads long --runs ours_cp2 --gpus 2 --steps 8 ;;
  varlen_moe)  # GPU 0: variable-length MoE SFT, both paths | GPU 1: the GPU tests; then DP2 and EP2 of our path
    bench 0 g4 --workloads varlen_moe --gpus 1 & check_tests 1 & wait
    bench 0,1 g2 --workloads dp2,moe_ep2 --gpus 2 --paths ours ;;
  pair_ours)  # two GPUs: our path's DP2, EP2 and long-context (1 GPU, CP2) runs again after a change
    bench 0,1 g2 --workloads dp2,moe_ep2 --gpus 2 --paths ours
    bench 0,1 g3 --workloads long --runs ours,ours_cp2 --gpus 2 --steps 8 ;;
  vl)  # one GPU: Qwen2.5-VL-7B shape, LF padded vs ours padded vs ours packed
    bench 0 g5 --workloads vl --gpus 1 --steps 8 --warmup 3 ;;
  vl_moe)  # one GPU: Qwen3-VL-30B-A3B shape, the same three runs
    bench 0 g5 --workloads vl_moe --gpus 1 --steps 8 --warmup 3 ;;
  lora)  # one H200 (ours peaks at 83 GiB on the MoE): both LoRA workloads' headline pair (lf, ours), MoE then dense;
    # each run took 60-80 s on an H200 (results/h200_lora): ~5 min plus building the 61 and 16 GB models on a fresh
    # machine. The other runs (ours_recompute, ours_experts): phases lora_moe_ours, lora_dense
    bench 0 g6 --workloads lora_moe --gpus 1 --steps 6 --warmup 2 --timeout 240 --runs lf,ours
    bench 0 g7 --workloads lora_dense --gpus 1 --steps 8 --warmup 2 --timeout 240 --runs lf,ours ;;
  profile)  # one GPU: a step under the profiler, ours and megatron-core's fallbacks (--baseline), dense and MoE
    shapes=("" "--moe --layers 8"); [ -n "${SHAPE:-}" ] && shapes=("$SHAPE")  # SHAPE: one of them only
    for shape in "${shapes[@]}"; do for variant in "" "--baseline"; do
      python3 benchmarks/profile_step.py $shape $variant --out "$out/profile" >> "$out/profile.log" 2>&1
      echo "== profile $shape $variant: exit $?"; grep -E "^- (step|GPU|MFU|per step)" "$out/profile.log" | tail -n 4
    done; done ;;
  speed_profile)  # one GPU: the GPU tests, then a dense step under the profiler: ours, megatron-core's fallbacks, and
    # ours with one change left out or (gradient_accumulation_fusion, off by default) put in
    check_tests 0
    for variant in "" "--baseline" "--off native_cross_entropy" "--on gradient_accumulation_fusion"; do
      python3 benchmarks/profile_step.py $variant --out "$out/profile" >> "$out/profile.log" 2>&1
      echo "== profile $variant: exit $?"; grep -E "^- (step|GPU|MFU|per step)" "$out/profile.log" | tail -n 4
    done ;;
  speed_dense)  # one GPU: dense with LLaMA-Factory's default and Liger rows beside ours; our dense and MoE profiles
    bench 0 g8 --workloads dense --gpus 1 --runs lf,lf_liger,ours --timeout 200
    for shape in "" "--moe --layers 8"; do
      python3 benchmarks/profile_step.py $shape --out "$out/profile" >> "$out/profile.log" 2>&1
      echo "== profile $shape: exit $?"; grep -E "^- (step|GPU|MFU|per step)" "$out/profile.log" | tail -n 4
    done ;;
  speed_moe)  # one GPU: MoE, LLaMA-Factory's default and Liger rows beside ours
    bench 0 g9 --workloads moe --gpus 1 --runs lf,lf_liger,ours --timeout 240 ;;
  speed_long)  # one GPU: 32k context, LLaMA-Factory's default and Liger rows beside ours
    bench 0 g10 --workloads long --gpus 1 --runs lf,lf_liger,ours --steps 6 --warmup 2 --timeout 200 ;;
  glm)  # one H200: GLM-4.5-Air shape (3 layers: 1 dense, 2 MoE), full fine-tuning, LLaMA-Factory's default vs ours
    bench 0 g11 --workloads glm_moe --gpus 1 --timeout 300 ;;
  glm_mtp)  # one H200: GLM-4.5-Air shape, 2 layers + its MTP layer (ours trains it; LLaMA-Factory's default drops it)
    bench 0 g13 --workloads glm_mtp --gpus 1 --timeout 300 --runs "${RUNS:-lf,ours,ours_no_mtp}" ;;
  qwen3_next)  # one H200: the Qwen3-Next / Qwen3.5 GPU tests, the delta rule alone (transformers' vs ours), then the
    # Qwen3-Next-80B-A3B shape (3 layers), packed and padded
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests/gpu/test_qwen3_next_gpu.py -q -p no:cacheprovider \
      > "$out/gpu_tests.log" 2>&1; echo "== qwen3_next gpu tests: exit $?"; tail -n 5 "$out/gpu_tests.log"
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/delta_rule_bench.py --out "$out" > "$out/delta_rule.log" 2>&1
    echo "== delta rule bench: exit $?"; tail -n 8 "$out/delta_rule.log"
    bench 0 g14 --workloads qwen3_next --gpus 1 --steps 8 --warmup 3 --timeout 240 --runs "${RUNS:-lf_pack,ours_pack,lf_nopack,ours_nopack,ours_nopack_padded}" ;;
  qwen3_5)  # one H200: Qwen3.5-35B-A3B shape (4 layers + its MTP layer), one image per row, padded and packed
    bench 0 g15 --workloads qwen3_5 --gpus 1 --steps 8 --warmup 3 --timeout 300 --runs "${RUNS:-lf_nopack,ours_nopack,ours_nopack_no_mtp,ours_pack}" ;;
  moonlight)  # one H200: Moonlight-16B-A3B shape (DeepSeek-V3 architecture, 8 layers), LLaMA-Factory's default vs ours
    bench 0 g12 --workloads moonlight --gpus 1 --timeout 300 ;;
  lora_moe_again)  # one H200: LoRA MoE runs (RUNS, default ours) again, merged beside the others of results/h200_lora
    mkdir -p "$out/g6"; cp benchmarks/results/h200_lora/e2e.json "$out/g6/e2e.json"
    bench 0 g6 --workloads lora_moe --gpus 1 --steps 6 --warmup 2 --timeout 300 --runs "${RUNS:-ours}" ;;
  lora_moe_lf)  # one H200: Qwen3-30B-A3B (all 48 layers) LoRA, LLaMA-Factory's default path (builds the 61 GB model)
    bench 0 g6 --workloads lora_moe --gpus 1 --steps 6 --warmup 2 --timeout 480 --runs lf ;;
  lora_moe_ours)  # our path: as is, with recompute (LLaMA-Factory's like for like), with expert adapters
    bench 0 g6 --workloads lora_moe --gpus 1 --steps 6 --warmup 2 --timeout 200 --runs ours,ours_recompute,ours_experts ;;
  lora_dense)  # one GPU: Qwen3-8B shape (36 layers) LoRA, both paths
    bench 0 g7 --workloads lora_dense --gpus 1 --steps 8 --warmup 2 ;;
  single_ours)  # one GPU: our path's single-GPU runs again after a change, then the MoE run's peak-memory report
    bench 0 g0 --workloads dense,varlen,varlen_moe,moe --paths ours --gpus 1
    USE_MCA=1 LLAMAFACTORY_MCA_MEMORY_REPORT="$out/memory_moe.md" timeout 120 \
      llamafactory-cli train "$work/e2e_g0/gpu/runs/moe/ours/recipe.yaml" > "$out/memory_moe.log" 2>&1
    echo "== memory report: exit $?"; cat "$out/memory_moe.md" ;;
esac
