# Shared by the run scripts: print the configuration, then launch grpo_jsonl.py under torchrun.
# Every variable can be overridden from the environment; paths are relative to the repo root.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

NPROC="${NPROC:-1}"
MASTER_PORT="${MASTER_PORT:-29500}"
PYTHON="${PYTHON:-python}"

launch() {
  echo "================ vlm-grpo run: $EXP_NAME ================"
  echo "MODEL        = $MODEL"
  echo "DATA         = $DATA"
  echo "IMAGES       = $IMAGES"
  echo "NPROC        = $NPROC"
  echo "OUTPUT_DIR   = $OUTPUT_DIR"
  echo "DEEPSPEED    = ${DEEPSPEED:-none}"
  echo "RESUME       = ${RESUME:-false}"
  echo "extra args   = $*"
  echo "========================================================="
  mkdir -p "$OUTPUT_DIR"
  local ds_args=()
  if [ -n "${DEEPSPEED:-}" ]; then ds_args=(--deepspeed "$DEEPSPEED"); fi
  "$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "$MASTER_PORT" \
    src/vlm_grpo/grpo_jsonl.py \
    --model_name_or_path "$MODEL" \
    --data_file_paths "$DATA" \
    --image_folders "$IMAGES" \
    --output_dir "$OUTPUT_DIR" \
    --resume_from_checkpoint "${RESUME:-false}" \
    "${ds_args[@]}" \
    "$@" 2>&1 | tee -a "$OUTPUT_DIR/train.log"
}
