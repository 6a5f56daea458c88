#!/usr/bin/env bash
# InternVL (native transformers "-hf" checkpoints) VQA with think/answer format, under ZeRO-2.
#   MODEL=OpenGVLab/InternVL3-1B-hf DATA=vqa.jsonl IMAGES=coco/train2014 NPROC=2 bash run_scripts/run_grpo_vqa_internvl.sh
source "$(dirname "$0")/_common.sh"
EXP_NAME="${EXP_NAME:-internvl-vqa}"
MODEL="${MODEL:-OpenGVLab/InternVL3-1B-hf}"
DATA="${DATA:-data/demo/train.jsonl}"
IMAGES="${IMAGES:-data/demo/images}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
DEEPSPEED="${DEEPSPEED-local_scripts/zero2.json}"
launch --config configs/grpo_vqa_internvl.yaml "$@"
