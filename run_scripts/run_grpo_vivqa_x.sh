#!/usr/bin/env bash
# The ViVQA-X seed: InternVL on Vietnamese VQA with think / answer / explain, full fine-tuning, ZeRO-2.
# Rewards: vqa_graded + format_explain + explanation (the seed's "accuracy format explanation").
#   vlm-grpo-data convert-vqa -i ViVQA-X_train.json -o data/vivqa_x/train.jsonl \
#       --prompt_file configs/templates/vivqa_x_prompt.txt --image_template 'COCO_train2014_{image_id:012d}.jpg'
#   MODEL=OpenGVLab/InternVL3-1B-hf DATA=data/vivqa_x/train.jsonl IMAGES=coco/train2014 NPROC=2 \
#       bash run_scripts/run_grpo_vivqa_x.sh
source "$(dirname "$0")/_common.sh"
EXP_NAME="${EXP_NAME:-vivqa-x-internvl}"
MODEL="${MODEL:-OpenGVLab/InternVL3-1B-hf}"
DATA="${DATA:-data/vivqa_x/train.jsonl}"
IMAGES="${IMAGES:-coco/train2014}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
DEEPSPEED="${DEEPSPEED:-local_scripts/zero2.json}"
launch --config configs/vivqa_x_internvl.yaml "$@"
