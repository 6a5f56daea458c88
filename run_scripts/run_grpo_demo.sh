#!/usr/bin/env bash
# The demo run on CPU: a tiny offline Qwen2.5-VL (built here if missing) on data/demo.
#   bash run_scripts/run_grpo_demo.sh            (a 6-step smoke run; `make demo` is the learning demo, vlm_grpo.demo)
source "$(dirname "$0")/_common.sh"
EXP_NAME="${EXP_NAME:-demo}"
MODEL="${MODEL:-runs/tiny/qwen2_5_vl}"
DATA="${DATA:-data/demo/train.jsonl}"
IMAGES="${IMAGES:-data/demo/images}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
if [ ! -f "$MODEL/config.json" ]; then
  "$PYTHON" -m vlm_grpo.testing.tiny --family qwen2_5_vl --out "$MODEL"
fi
launch --config configs/demo.yaml "$@"
