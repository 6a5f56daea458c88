#!/usr/bin/env bash
# Qwen2.5-VL REC with LoRA on the language model and a frozen vision tower, under ZeRO-2.
#   MODEL=Qwen/Qwen2.5-VL-7B-Instruct DATA=rec.jsonl IMAGES=coco/ NPROC=4 bash run_scripts/run_grpo_rec_lora.sh
source "$(dirname "$0")/_common.sh"
EXP_NAME="${EXP_NAME:-qwen2.5vl-rec-lora}"
MODEL="${MODEL:-Qwen/Qwen2.5-VL-7B-Instruct}"
DATA="${DATA:-data/demo/train.jsonl}"
IMAGES="${IMAGES:-data/demo/images}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
DEEPSPEED="${DEEPSPEED-local_scripts/zero2.json}"
launch --config configs/grpo_rec_lora.yaml "$@"
