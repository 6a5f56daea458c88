# Shared by the run scripts: pick the Python, print the configuration and the command, then launch
# grpo_jsonl.py under torchrun. Every variable can be overridden from the environment; paths are relative
# to the repo root.
#   PYTHON     default: the repo's .venv/bin/python when present, else python3
#   DEEPSPEED  a config file, or none / "" for no DeepSpeed. Without a GPU DeepSpeed is left out (its CPU
#              path compiles a C++ op for minutes); DEEPSPEED_ON_CPU=1 keeps it.
#   NPROC      processes (GPUs) per node [1]
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   several machines [1, 0, 127.0.0.1, 29500]: run the same
#              script on every node with its own NODE_RANK and node 0's address as MASTER_ADDR
#   RDZV_ENDPOINT  host:port of a c10d rendezvous instead (elastic: no NODE_RANK needed; RDZV_ID names the job)
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

NPROC="${NPROC:-1}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
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

# torchrun's placement flags: one node, several nodes (static ranks), or a c10d rendezvous.
torchrun_args() {
  printf '%s\n' --nproc_per_node "$NPROC" --nnodes "$NNODES"
  if [ -n "${RDZV_ENDPOINT:-}" ]; then
    printf '%s\n' --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-vlm-grpo}"
  else
    printf '%s\n' --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
  fi
}

show_and_run() {
  echo "+ $(printf '%q ' "$@")"
  "$@"
}

launch() {
  local ds_args=() run_args=()
  mapfile -t ds_args < <(deepspeed_args)
  mapfile -t run_args < <(torchrun_args)
  echo "================ vlm-grpo run: $EXP_NAME ================"
  echo "PYTHON       = $PYTHON"
  echo "MODEL        = $MODEL"
  echo "DATA         = $DATA"
  echo "IMAGES       = $IMAGES"
  echo "NPROC        = $NPROC"
  echo "NODES        = $NNODES (this node: $NODE_RANK; ${RDZV_ENDPOINT:+rendezvous $RDZV_ENDPOINT}${RDZV_ENDPOINT:-master $MASTER_ADDR:$MASTER_PORT})"
  echo "OUTPUT_DIR   = $OUTPUT_DIR"
  echo "DEEPSPEED    = ${ds_args[1]:-none}"
  echo "RESUME       = ${RESUME:-false}"
  echo "extra args   = $*"
  echo "========================================================="
  mkdir -p "$OUTPUT_DIR"
  show_and_run "$PYTHON" -m torch.distributed.run "${run_args[@]}" \
    src/vlm_grpo/grpo_jsonl.py \
    --model_name_or_path "$MODEL" \
    --data_file_paths "$DATA" \
    --image_folders "$IMAGES" \
    --output_dir "$OUTPUT_DIR" \
    --resume_from_checkpoint "${RESUME:-false}" \
    "${ds_args[@]}" \
    "$@" 2>&1 | tee -a "$OUTPUT_DIR/train.log"
}

# After a successful run: remove DIR/checkpoint-* (the final model stays in DIR), as the Lewis seed's scripts do.
# KEEP_CHECKPOINTS=1 keeps them (to resume or compare later).
remove_checkpoints() {
  local dir="$1" d
  if [ "${KEEP_CHECKPOINTS:-0}" = 1 ]; then return 0; fi
  for d in "$dir"/checkpoint-*; do
    if [ -d "$d" ]; then
      echo "Removing $d"
      rm -rf -- "$d"
    fi
  done
}
