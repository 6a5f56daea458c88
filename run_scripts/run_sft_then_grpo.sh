#!/usr/bin/env bash
# The two-stage pipeline: preprocess -> check -> SFT -> GRPO from the SFT model -> evaluate.
# Defaults run the demo data with a tiny offline Qwen2.5-VL on CPU (built here if missing):
#   bash run_scripts/run_sft_then_grpo.sh
# On real data (RynnBrain-style raw records with Thinking turns):
#   RAW=/data/raw/trajectory.jsonl TASK=trajectory IMAGES=/data/media MODEL=Qwen/Qwen2.5-VL-7B-Instruct \
#   NPROC=8 SFT_STEPS=2000 GRPO_STEPS=500 REWARDS="format_rynnbrain accuracy" \
#   SFT_ARGS="--bf16 true --gradient_checkpointing true" bash run_scripts/run_sft_then_grpo.sh
# Every variable below can be set from the environment; *_ARGS are passed to that stage as extra flags.
source "$(dirname "$0")/_common.sh"

EXP_NAME="${EXP_NAME:-pipeline}"
MODEL="${MODEL:-runs/tiny/qwen2_5_vl}"
RAW="${RAW:-data/demo/train.jsonl}"
IMAGES="${IMAGES:-$([ "$RAW" = data/demo/train.jsonl ] && echo data/demo/images || dirname "$RAW")}"
TASK="${TASK:-}"                       # task of raw records without their own task_type
SIMPLE="${SIMPLE:-$([ "$RAW" = data/demo/train.jsonl ] && echo true || echo false)}"  # SFT rows without Thinking
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
DATA_DIR="${DATA_DIR:-$OUTPUT_DIR/data}"
TRAIN_SPLIT="${TRAIN_SPLIT:-80}"
SEED="${SEED:-42}"
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-512}"
SFT_CONFIG="${SFT_CONFIG:-configs/sft_demo.yaml}"
GRPO_CONFIG="${GRPO_CONFIG:-configs/demo.yaml}"
SFT_STEPS="${SFT_STEPS:-8}"
GRPO_STEPS="${GRPO_STEPS:-4}"
REWARDS="${REWARDS:-accuracy format iou}"
EVAL_BATCH="${EVAL_BATCH:-8}"
EVAL_MAX_NEW_TOKENS="${EVAL_MAX_NEW_TOKENS:-32}"
read -r -a SFT_EXTRA <<<"${SFT_ARGS:-}"
read -r -a GRPO_EXTRA <<<"${GRPO_ARGS:-}"
read -r -a EVAL_EXTRA <<<"${EVAL_ARGS:-}"
read -r -a REWARD_LIST <<<"$REWARDS"

echo "================ vlm-grpo pipeline: $EXP_NAME ================"
echo "MODEL      = $MODEL"
echo "RAW        = $RAW  (images: $IMAGES, task: ${TASK:-from rows}, simple SFT rows: $SIMPLE)"
echo "OUTPUT_DIR = $OUTPUT_DIR  (data in $DATA_DIR)"
echo "steps      = SFT $SFT_STEPS, GRPO $GRPO_STEPS; NPROC = $NPROC; DEEPSPEED = ${DEEPSPEED:-none}"
echo "rewards    = $REWARDS"
echo "=============================================================="
mkdir -p "$OUTPUT_DIR"
step() { echo; echo "---- [$EXP_NAME +${SECONDS}s] $* ----"; }

if [ ! -f "$MODEL/config.json" ] && [ "$MODEL" = runs/tiny/qwen2_5_vl ]; then
  step "building the tiny offline model"
  "$PYTHON" -m vlm_grpo.testing.tiny --family qwen2_5_vl --out "$MODEL"
fi
mapfile -t ds_args < <(deepspeed_args)
pre_args=(--train_split "$TRAIN_SPLIT" --seed "$SEED" -y)
if [ -n "$TASK" ]; then pre_args+=(--task_type "$TASK"); fi
if [ "$SIMPLE" = true ]; then pre_args+=(--simple); fi

step "1/5 preprocess: raw records -> GRPO rows (rl) + SFT rows (cot), merged per stage"
"$PYTHON" -m vlm_grpo.data preprocess -i "$RAW" -o "$DATA_DIR" "${pre_args[@]}"
"$PYTHON" -m vlm_grpo.data merge -i "$DATA_DIR" --stage rl -o "$DATA_DIR/rl" -y
"$PYTHON" -m vlm_grpo.data merge -i "$DATA_DIR" --stage cot -o "$DATA_DIR/cot" -y
TEST_FILE="$DATA_DIR/rl/test.jsonl"
if [ ! -f "$TEST_FILE" ]; then TEST_FILE="$DATA_DIR/rl/train.jsonl"; fi  # --train_split 100: evaluate on train

step "2/5 check: the data against the images and the model's processor"
"$PYTHON" -m vlm_grpo.data check "$DATA_DIR/cot/train.jsonl" "$DATA_DIR/rl/train.jsonl" "$TEST_FILE" \
  --image_folders "$IMAGES" --model "$MODEL" --max_prompt_length "$MAX_PROMPT_LENGTH" --report "$OUTPUT_DIR/check.json"

step "3/5 SFT on the chain-of-thought rows"
mapfile -t RUN_ARGS < <(torchrun_args)
show_and_run "$PYTHON" -m torch.distributed.run "${RUN_ARGS[@]}" src/vlm_grpo/sft_jsonl.py \
  --config "$SFT_CONFIG" --model_name_or_path "$MODEL" \
  --data_file_paths "$DATA_DIR/cot/train.jsonl" --image_folders "$IMAGES" \
  --max_prompt_length "$MAX_PROMPT_LENGTH" --output_dir "$OUTPUT_DIR/sft" --max_steps "$SFT_STEPS" --seed "$SEED" \
  "${ds_args[@]}" "${SFT_EXTRA[@]}" 2>&1 | tee "$OUTPUT_DIR/sft.log"

step "4/5 GRPO from the SFT model"
show_and_run "$PYTHON" -m torch.distributed.run "${RUN_ARGS[@]}" src/vlm_grpo/grpo_jsonl.py \
  --config "$GRPO_CONFIG" --model_name_or_path "$OUTPUT_DIR/sft" \
  --data_file_paths "$DATA_DIR/rl/train.jsonl" --image_folders "$IMAGES" --reward_funcs "${REWARD_LIST[@]}" \
  --max_prompt_length "$MAX_PROMPT_LENGTH" --output_dir "$OUTPUT_DIR/grpo" --overwrite_output_dir true \
  --max_steps "$GRPO_STEPS" --save_strategy no --seed "$SEED" \
  "${ds_args[@]}" "${GRPO_EXTRA[@]}" 2>&1 | tee "$OUTPUT_DIR/grpo.log"

step "5/5 evaluate the GRPO model on the held-out rows"
"$PYTHON" -m vlm_grpo.evaluate --model_name_or_path "$OUTPUT_DIR/grpo" \
  --data_file_paths "$TEST_FILE" --image_folders "$IMAGES" --reward_funcs "${REWARD_LIST[@]}" \
  --max_prompt_length "$MAX_PROMPT_LENGTH" --batch_size "$EVAL_BATCH" --max_new_tokens "$EVAL_MAX_NEW_TOKENS" \
  --seed "$SEED" --output_dir "$OUTPUT_DIR/eval" "${EVAL_EXTRA[@]}"

echo
echo "Done in ${SECONDS}s: SFT model $OUTPUT_DIR/sft, GRPO model $OUTPUT_DIR/grpo, evaluation $OUTPUT_DIR/eval/summary.json"
