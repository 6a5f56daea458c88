#!/usr/bin/env bash
# DeepEyes-style zoom-in (image_zoom_in_tool, the deepeyes reward) on the synthetic "small marked object" set
# (generated here if missing). The tiny random default only checks the wiring (it never calls a tool); the CPU
# demo whose model calls tools is `make demo-tools`.
#   bash run_scripts/run_grpo_zoom_in.sh                                      (CPU, tiny offline Qwen2.5-VL)
#   MODEL=Qwen/Qwen2.5-VL-7B-Instruct NPROC=8 DEEPSPEED=local_scripts/zero3.json \
#     bash run_scripts/run_grpo_zoom_in.sh --max_steps 200 --learning_rate 1e-6 --bf16 true
source "$(dirname "$0")/_common.sh"
EXP_NAME="${EXP_NAME:-zoom_in}"
MODEL="${MODEL:-runs/tiny/qwen2_5_vl}"
DATA="${DATA:-runs/data/zoom_in/train.jsonl}"
IMAGES="${IMAGES:-runs/data/zoom_in/images}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
if [ "$MODEL" = "runs/tiny/qwen2_5_vl" ] && [ ! -f "$MODEL/config.json" ]; then
  "$PYTHON" -m vlm_grpo.testing.tiny --family qwen2_5_vl --out "$MODEL"
fi
if [ ! -f "$DATA" ]; then
  "$PYTHON" -m vlm_grpo.data.zoom_in_demo --out "$(dirname "$DATA")"
fi
launch --config configs/grpo_zoom_in.yaml "$@"
