#!/usr/bin/env bash
# The EasyR1-shaped benchmark with a warm start (the RESULTS.md tables "shape_*"), on one GPU:
#
#   bash benchmarks/shape_run.sh OUT_DIR [SHAPE] [PRESET] [SECONDS]
#
# 1. cold:    VLMGRPOTrainer, two cycles, with an empty compile cache (compile_cache_dir): the first cycle pays the
#             compilation, the second is the steady one; the first generation's lengths correct the EOS bias;
# 2. warm:    VLMGRPOTrainer again with the same cache, one cycle: the warm start;
# 3. vanilla: trl.GRPOTrainer, one cycle (it compiles nothing);
# the warm and vanilla runs take the cold run's corrected EOS bias (--eos_bias): all three sample one distribution.
# A one-cycle run of the tiny model first goes through the same code (rewards, logging, both trainers) in seconds:
# a missing package stops the script there, before any large model is loaded.
# Then bench_shape.py merges the three into OUT_DIR/shape_<SHAPE>_<PRESET>.json. SECONDS bounds the whole script:
# a stage still running at its share of it gets SIGTERM and reports the cycles it finished (status "stopped by the
# time limit").
#
# STAGES="cold" / STAGES="warm vanilla" runs only those stages (e.g. in two commands where one command's time is
# limited), each then with the whole of SECONDS; give both the same VLM_GRPO_COMPILE_CACHE and OUT_DIR: a later
# stage reads the cold run's folder and result (its corrected EOS bias), and only the cold stage empties the folder.
set -uo pipefail
out=${1:?output folder}
shape=${2:-easyr1_geo3k}
preset=${3:-qwen2_5_vl_3b}
deadline=${4:-3600}
here=$(cd "$(dirname "$0")" && pwd)
stages=${STAGES:-cold warm vanilla}
export VLM_GRPO_COMPILE_CACHE=${VLM_GRPO_COMPILE_CACHE:-$(mktemp -d)/compile}
case " $stages " in *" cold "*) rm -rf "$VLM_GRPO_COMPILE_CACHE" ;; esac
mkdir -p "$out"
runs() { case " $stages " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
declare -A weight=([cold]=50 [warm]=28 [vanilla]=22)  # each stage's share of SECONDS when all three run
share() {  # share STAGE: seconds from now until the end of STAGE's share among the stages run (time left over flows on)
  local total=0 upto=0 s
  for s in cold warm vanilla; do
    runs $s || continue
    total=$((total + weight[$s]))
    [ -z "${done_upto:-}" ] && upto=$((upto + weight[$s]))
    [ "$s" = "$1" ] && done_upto=1
  done
  unset done_upto
  echo $((deadline * upto / total - 15 - SECONDS))
}
bench() {  # bench SECONDS OUT_NAME ARGS...: one bench_grpo.py run of the shape, stopped after SECONDS
  local seconds=$1 name=$2
  shift 2
  if [ "$seconds" -lt 30 ]; then echo "$name: no time left"; return; fi
  timeout "$seconds" python3 "$here/bench_grpo.py" --preset "$preset" --shape "$shape" "$@" --out "$out/$name.json"
  echo "$name exit status: $?"
}
timeout 120 python3 "$here/bench_grpo.py" --preset tiny --trainers ours vanilla --warmup 0 --steps 1 \
  --shape "${shape%%:*}:prompts=4,image_size=56,max_completion=16,mean_completion=4,micro_batch=5" \
  --out "$out/preflight.json" > "$out/preflight.log" 2>&1 || { tail -20 "$out/preflight.log"; exit 1; }
runs cold && bench "$(share cold)" cold --trainers ours --warmup 1 --steps 1
bias=$(python3 "$here/bench_shape.py" --bias_of "$out/cold.json")  # empty when the cold run did not correct it
runs warm && bench "$(share warm)" warm --trainers ours --warmup 0 --steps 1 ${bias:+--eos_bias "$bias"}
runs vanilla && bench "$(share vanilla)" vanilla --trainers vanilla --warmup 0 --steps 1 ${bias:+--eos_bias "$bias"}
python3 "$here/bench_shape.py" --cold "$out/cold.json" --warm "$out/warm.json" --vanilla "$out/vanilla.json" \
  --command "bash benchmarks/shape_run.sh OUT $shape $preset $deadline" --out "$out/shape_${shape%%:*}_${preset}.json"
