#!/usr/bin/env bash
# One GRPO step per model family's real-shape preset on one GPU: vanilla TRL and VLMGRPOTrainer in the same process
# (bench_grpo.py), 448 px, 128-token completions, 2 prompts x G=8. Usage (on a GPU machine, from the repo root):
#   source benchmarks/device_env.sh && bash benchmarks/family_rows.sh OUT_DIR [SECONDS_PER_PRESET, default 240]
# (a preset needs about 50 s for vanilla TRL and 70-100 s for VLMGRPOTrainer, whose first step compiles).
# Presets too large for full fine-tuning on one card train a rank-64 LoRA (both trainers); GLM-4.5V (106B) does not
# fit one card at all and is left out.
set -uo pipefail
out=${1:?output folder}
limit=${2:-240}
mkdir -p "$out"
logs=$(mktemp -d)  # one log per preset; their tails go to $out/family_logs.txt
run() {  # preset, extra bench_grpo flags
  local preset=$1; shift
  timeout --signal=TERM "$limit" python3 benchmarks/bench_grpo.py --preset "$preset" --device cuda --dtype bfloat16 \
    --image_sizes 448 --completion_lengths 128 --num_generations 8 --prompts_per_step 2 --steps 1 --warmup 1 \
    --trainers vanilla ours --seed 0 --out "$out/family_${preset}.json" "$@" >"$logs/$preset.log" 2>&1
  local rc=$?
  echo "$preset: exit $rc $(grep -E '^\[bench' "$logs/$preset.log" | tail -2 | cut -c1-300)"
  { echo "== $preset (exit $rc)"; tail -n 30 "$logs/$preset.log"; } >>"$out/family_logs.txt"
}
run glm4v_9b
run llava_onevision_7b
run smolvlm_2b
run mistral3_24b --lora_r 64 --lora_dropout 0
run gemma3_4b
run qwen3_vl_30b_a3b --lora_r 64 --lora_dropout 0
