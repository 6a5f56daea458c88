#!/usr/bin/env bash
# Qwen2.5-VL referring-expression grounding (REC), full fine-tuning under DeepSpeed ZeRO-3.
#   MODEL=Qwen/Qwen2.5-VL-3B-Instruct DATA=rec.jsonl IMAGES=coco/ NPROC=8 bash run_scripts/run_grpo_rec.sh
source "$(dirname "$0")/_common.sh"
EXP_NAME="${EXP_NAME:-qwen2.5vl-rec-zero3}"
MODEL="${MODEL:-Qwen/Qwen2.5-VL-3B-Instruct}"
DATA="${DATA:-data/demo/train.jsonl}"
IMAGES="${IMAGES:-data/demo/images}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
DEEPSPEED="${DEEPSPEED-local_scripts/zero3.json}"
launch --config configs/grpo_rec.yaml "$@"
