#!/usr/bin/env bash
# The EasyR1-shaped benchmark with a warm start (the RESULTS.md tables "shape_*"), on one GPU:
#
#   bash benchmarks/shape_run.sh OUT_DIR [SHAPE] [PRESET] [SECONDS]
#
# 1. cold:    VLMGRPOTrainer, two cycles, with an empty compile cache (compile_cache_dir): the first cycle pays the
#             compilation, the second is the steady one;
# 2. warm:    VLMGRPOTrainer again with the same cache, one cycle: the warm start;
# 3. vanilla: trl.GRPOTrainer, one cycle (it compiles nothing);
# then bench_shape.py merges the three into OUT_DIR/shape_<SHAPE>_<PRESET>.json. SECONDS bounds the whole script:
# a stage still running at its share of it gets SIGTERM and reports the cycles it finished (status "stopped by the
# time limit").
set -uo pipefail
out=${1:?output folder}
shape=${2:-easyr1_geo3k}
preset=${3:-qwen2_5_vl_3b}
deadline=${4:-3600}
here=$(cd "$(dirname "$0")" && pwd)
export VLM_GRPO_COMPILE_CACHE=${VLM_GRPO_COMPILE_CACHE:-$(mktemp -d)/compile}
rm -rf "$VLM_GRPO_COMPILE_CACHE"
mkdir -p "$out"
bench() {  # bench SECONDS OUT_NAME ARGS...: one bench_grpo.py run of the shape, stopped after SECONDS
  local seconds=$1 name=$2
  shift 2
  if [ "$seconds" -lt 30 ]; then echo "$name: no time left"; return; fi
  timeout "$seconds" python3 "$here/bench_grpo.py" --preset "$preset" --shape "$shape" "$@" --out "$out/$name.json"
  echo "$name exit status: $?"
}
bench $((deadline * 50 / 100)) cold --trainers ours --warmup 1 --steps 1
bench $((deadline * 78 / 100 - SECONDS)) warm --trainers ours --warmup 0 --steps 1
bench $((deadline - 15 - SECONDS)) vanilla --trainers vanilla --warmup 0 --steps 1
python3 "$here/bench_shape.py" --cold "$out/cold.json" --warm "$out/warm.json" --vanilla "$out/vanilla.json" \
  --command "bash benchmarks/shape_run.sh OUT $shape $preset $deadline" --out "$out/shape_${shape%%:*}_${preset}.json"
