#!/usr/bin/env bash
# The EasyR1-shaped benchmark with a warm start (the RESULTS.md table "shape_*"), on one GPU:
#
#   bash benchmarks/shape_run.sh OUT_DIR [SHAPE] [PRESET] [SECONDS]
#
# SECONDS bounds the whole script: vanilla TRL gets what is left of it (less 20 s for the merge).
# 1. cold:    VLMGRPOTrainer, one cycle, with an empty compile cache (compile_cache_dir);
# 2. warm:    the same command again, same cache, two cycles (the first is the warm start, the second the steady one);
# 3. vanilla: trl.GRPOTrainer, one cycle (it compiles nothing);
# then bench_shape.py merges the three into OUT_DIR/shape_<SHAPE>.json. Every stage writes its JSON as it ends.
set -uo pipefail
out=${1:?output folder}
shape=${2:-easyr1_geo3k}
preset=${3:-qwen2_5_vl_3b}
deadline=${4:-3600}
here=$(cd "$(dirname "$0")" && pwd)
export VLM_GRPO_COMPILE_CACHE=${VLM_GRPO_COMPILE_CACHE:-$(mktemp -d)/compile}
rm -rf "$VLM_GRPO_COMPILE_CACHE"
mkdir -p "$out"
bench() { python3 "$here/bench_grpo.py" --preset "$preset" --shape "$shape" "$@"; }
bench --trainers ours --warmup 0 --steps 1 --out "$out/cold.json"
bench --trainers ours --warmup 1 --steps 1 --out "$out/warm.json"
vanilla_s=$((deadline - SECONDS - 20))
[ "$vanilla_s" -gt 30 ] && timeout "$vanilla_s" python3 "$here/bench_grpo.py" --preset "$preset" --shape "$shape" --trainers vanilla \
  --warmup 0 --steps 1 --out "$out/vanilla.json"
echo "vanilla exit status: $?"
python3 "$here/bench_shape.py" --cold "$out/cold.json" --warm "$out/warm.json" --vanilla "$out/vanilla.json" \
  --vanilla_seconds "$vanilla_s" --command "bash benchmarks/shape_run.sh OUT $shape $preset $deadline" \
  --out "$out/shape_${shape%%:*}_${preset}.json"
