# Shared by the run scripts: pick the Python, print the configuration and the command, then launch
# grpo_jsonl.py under torchrun. Every variable can be overridden from the environment; paths are relative
# to the repo root.
#   PYTHON     default: the repo's .venv/bin/python when present, else python3
#   DEEPSPEED  a config file, or none / "" for no DeepSpeed. Without a GPU DeepSpeed is left out (its CPU
#              path compiles a C++ op for minutes); DEEPSPEED_ON_CPU=1 keeps it.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

NPROC="${NPROC:-1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO_ROOT/.venv/bin/python" ]; then PYTHON="$REPO_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# The repo's own code, whether or not it is installed in that Python.
export PYTHONPATH="$REPO_ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("torch") else 1)' 2>/dev/null; then
  echo "error: $PYTHON has no torch installed. Run 'make setup' (creates .venv with everything) or set" \
       "PYTHON=/path/to/a/python/with/the/requirements" >&2
  exit 2
fi

# --deepspeed FILE, or nothing for DEEPSPEED=none/off/false/"" (and on machines without a GPU).
deepspeed_args() {
  local ds="${DEEPSPEED:-}"
  case "${ds,,}" in ""|none|off|false|no|0) return 0 ;; esac
  if ! nvidia-smi -L >/dev/null 2>&1 && [ "${DEEPSPEED_ON_CPU:-0}" != 1 ]; then
    echo "[run_scripts] no GPU found: running without DeepSpeed ($ds); DEEPSPEED_ON_CPU=1 keeps it" >&2
    return 0
  fi
  printf '%s\n' --deepspeed "$ds"
}

show_and_run() {
  echo "+ $(printf '%q ' "$@")"
  "$@"
}

launch() {
  local ds_args=()
  mapfile -t ds_args < <(deepspeed_args)
  echo "================ vlm-grpo run: $EXP_NAME ================"
  echo "PYTHON       = $PYTHON"
  echo "MODEL        = $MODEL"
  echo "DATA         = $DATA"
  echo "IMAGES       = $IMAGES"
  echo "NPROC        = $NPROC"
  echo "OUTPUT_DIR   = $OUTPUT_DIR"
  echo "DEEPSPEED    = ${ds_args[1]:-none}"
  echo "RESUME       = ${RESUME:-false}"
  echo "extra args   = $*"
  echo "========================================================="
  mkdir -p "$OUTPUT_DIR"
  show_and_run "$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "$MASTER_PORT" \
    src/vlm_grpo/grpo_jsonl.py \
    --model_name_or_path "$MODEL" \
    --data_file_paths "$DATA" \
    --image_folders "$IMAGES" \
    --output_dir "$OUTPUT_DIR" \
    --resume_from_checkpoint "${RESUME:-false}" \
    "${ds_args[@]}" \
    "$@" 2>&1 | tee -a "$OUTPUT_DIR/train.log"
}
