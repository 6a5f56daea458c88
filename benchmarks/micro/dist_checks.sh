#!/usr/bin/env bash
# Distributed checks at real size: grpo_jsonl.py under torchrun with the DeepSpeed configs,
# full and LoRA, frozen vision, gradient checkpointing, bf16, on a random model of a real preset.
# Each run trains STEPS steps on a mix of image and text-only rows (the ZeRO-3 hang case), saves,
# resumes for 2 more steps, and the result reloads with from_pretrained. One line per run.
#   NPROC=2 PRESET=qwen2_5_vl_3b bash benchmarks/micro/dist_checks.sh [RUN ...]
# RUN names: zero3_full zero3_vision zero2_lora zero3_lora zero2_full zero3_offload_full (default: all).
set -uo pipefail
cd "$(dirname "$0")/../.."
NPROC="${NPROC:-2}"
PRESET="${PRESET:-qwen2_5_vl_3b}"
STEPS="${STEPS:-5}"
WORK="${WORK:-/tmp/dist_checks}"
PER_RUN_TIMEOUT="${PER_RUN_TIMEOUT:-240}"
PY="${PYTHON:-python3}"
RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=(zero3_full zero3_vision zero2_lora zero3_lora zero2_full zero3_offload_full)
mkdir -p "$WORK"

MODEL="$WORK/model_$PRESET"
if [ ! -f "$MODEL/config.json" ]; then
  "$PY" -m vlm_grpo.testing.tiny --preset "$PRESET" --out "$MODEL" --device cuda --dtype bfloat16 || exit 1
fi
# Demo rows plus text-only rows: batches that mix both kinds.
DATA="$WORK/mixed.jsonl"
"$PY" - "$DATA" <<'PY'
import json, sys
rows = [json.loads(line) for line in open("data/demo/train.jsonl")][:24]
for i in range(8):
    rows.insert(3 * i, {"id": f"text-{i}", "conversations": [
        {"from": "human", "value": f"What is {i} plus {i + 1}?"}, {"from": "gpt", "value": f"<answer>{2 * i + 1}</answer>"}]})
open(sys.argv[1], "w").write("".join(json.dumps(r) + "\n" for r in rows))
PY

run() {  # name deepspeed_json extra_args...
  local name=$1 ds=$2; shift 2
  local out="$WORK/out_$name" log="$WORK/$name.log" start end rc1 rc2 reload
  rm -rf "$WORK"/out_*  # full-model checkpoints (weights + optimizer state) are tens of GB each
  local common=(--model_name_or_path "$MODEL" --data_file_paths "$DATA" --image_folders data/demo/images
    --reward_funcs accuracy format --output_dir "$out" --deepspeed "local_scripts/$ds.json"
    --per_device_train_batch_size 4 --num_generations 4 --max_completion_length 64 --learning_rate 1e-6
    --gradient_checkpointing true --bf16 true --attn_implementation sdpa --logging_steps 1 --report_to none
    --save_strategy steps --save_steps "$STEPS" --save_total_limit 1 --seed 1 "$@")
  start=$(date +%s)
  timeout "$PER_RUN_TIMEOUT" "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" src/vlm_grpo/grpo_jsonl.py \
    "${common[@]}" --max_steps "$STEPS" >"$log" 2>&1
  rc1=$?
  timeout "$PER_RUN_TIMEOUT" "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" src/vlm_grpo/grpo_jsonl.py \
    "${common[@]}" --max_steps $((STEPS + 2)) --resume_from_checkpoint true >>"$log" 2>&1
  rc2=$?
  end=$(date +%s)
  reload=$("$PY" - "$out" "$MODEL" <<'PY' 2>&1 | tail -1
import os, sys, torch
from transformers import AutoModelForImageTextToText
out, base = sys.argv[1], sys.argv[2]
if os.path.exists(os.path.join(out, "adapter_config.json")):
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.bfloat16), out)
    print("reload OK (adapter)")
else:
    model, info = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    bad = info["missing_keys"] or info["unexpected_keys"]
    print("reload OK" if not bad else f"reload BAD {bad[:3]}")
PY
)
  local steps peak
  steps=$(grep -o "\[vlm-grpo\] step [0-9]*" "$log" | awk '{print $3}' | tr '\n' ' ')
  peak=$(grep -o "peak GPU memory [0-9.]* GiB" "$log" | awk '{print $4}' | sort -n | tail -1)
  echo "[dist] $name: rc=$rc1/$rc2 steps=[$steps] ${end}-${start} -> $((end - start)) s, peak ${peak:-?} GiB/rank, $reload"
  if [ "$rc1" != 0 ] || [ "$rc2" != 0 ]; then grep -E "Error|error" "$log" | tail -5; fi
}

for r in "${RUNS[@]}"; do
  case $r in
    zero3_full) run zero3_full zero3 --freeze_vision_modules true ;;
    zero3_vision) run zero3_vision zero3 ;;  # trainable vision tower on mixed text-only / image batches
    zero2_lora) run zero2_lora zero2 --use_peft true --lora_r 16 --lora_alpha 32 --freeze_vision_modules true ;;
    zero3_lora) run zero3_lora zero3 --use_peft true --lora_r 16 --lora_alpha 32 ;;
    zero2_full) run zero2_full zero2 ;;
    zero3_offload_full) run zero3_offload_full zero3_offload --freeze_vision_modules true ;;
    *) echo "unknown run $r" ;;
  esac
done
