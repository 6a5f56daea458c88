#!/usr/bin/env bash
# Lewis game: train a speaker with GRPO against a listener model served over HTTP.
#
#   bash run_scripts/run_lewis_speaker.sh                 # CPU: starts its own listener (tiny offline models)
#   bash run_scripts/run_lewis_speaker.sh LISTENER_HOST [LISTENER_PORT] [EPOCHS] [DATASET] [SEED] [--flag value ...]
#                                                         # the seed's run_speaker_training.sh arguments: an
#                                                         # external listener already serving on HOST:PORT [9000]
#   MODEL=/ckpt/speaker LISTENER_MODEL=/ckpt/listener IMAGES=/data/perva NPROC=4 LISTENER_DEVICE=cuda:4 \
#     CUDA_VISIBLE_DEVICES=0,1,2,3,4 bash run_scripts/run_lewis_speaker.sh --max_steps 500
#
# Without LISTENER_HOST: 1. starts the listener service (python -m vlm_grpo.serve listener) in the background on
# loopback, 2. waits (bounded) until its /health answers, 3. trains the speaker with the rewards listener +
# format_speaker (<thinking> <coarse> <detailed> present) + one_sentence (configs/lewis_speaker.yaml), with
# LISTENER_URL pointing at the service, 4. stops the service when training ends, fails or is interrupted.
# With LISTENER_HOST: no service is started or stopped; the script waits for http://HOST:PORT/health, then trains.
# EPOCHS sets --num_train_epochs (and lifts the config's max_steps); DATASET names the run (OUTPUT_DIR
# runs/lewis_speaker_<DATASET>_seed_<SEED>); SEED [23] sets --seed. When training succeeds, the intermediate
# checkpoint-* folders are removed, as the seed's script does (KEEP_CHECKPOINTS=1 keeps them); the final model stays
# in OUTPUT_DIR. Arguments from the first --flag on go to the trainer (e.g. --dataset_name share_data/PerVA_..._K_3).
#
# Environment (defaults in brackets): MODEL [runs/tiny/qwen2_5_vl], LISTENER_MODEL [$MODEL], IMAGES
# [data/demo/images], DATA [$OUTPUT_DIR/data/train.jsonl, generated from IMAGES when missing: ROWS=16 games of
# K=3 candidates; not used with --dataset_name], OUTPUT_DIR [runs/$EXP_NAME], LISTENER_PORT [a free port; 9000 with
# LISTENER_HOST], LISTENER_DEVICE [cuda if present, else cpu], LISTENER_TOKEN [none; also handed to the service],
# HEALTH_TIMEOUT [300 s], DEBUG_MODE / LOG_PATH [true / $OUTPUT_DIR/lewis_$SLURM_JOB_ID.json: the listener's game
# predictions, one JSON line per game; the rollout log goes beside it as <name>.rollouts.jsonl], NPROC,
# MASTER_PORT, DEEPSPEED, RESUME, PYTHON. The listener's limits come from INFERENCE_CONCURRENCY,
# INFERENCE_ACQUIRE_TIMEOUT, LISTENER_BATCH_SIZE; the client's from LISTENER_TIMEOUT, LISTENER_CHUNK_SIZE,
# LISTENER_MAX_RETRIES, LISTENER_BACKOFF_FACTOR, ...
source "$(dirname "$0")/_common.sh"
# The seed's positional arguments: everything before the first --flag.
POSITIONAL=()
while [ "$#" -gt 0 ] && [[ "$1" != --* ]]; do
  POSITIONAL+=("$1")
  shift
done
if [ "${#POSITIONAL[@]}" -gt 5 ]; then
  echo "error: at most 5 arguments before the trainer's flags: LISTENER_HOST [LISTENER_PORT] [EPOCHS] [DATASET]" \
       "[SEED]; got ${POSITIONAL[*]}" >&2
  exit 2
fi
EXTERNAL_LISTENER=""
EPOCH_ARGS=()
if [ "${#POSITIONAL[@]}" -gt 0 ]; then
  EXTERNAL_LISTENER=1
  LISTENER_HOST="${POSITIONAL[0]}"
  LISTENER_PORT="${POSITIONAL[1]:-9000}"
  EPOCHS="${POSITIONAL[2]:-4}"
  DATASET="${POSITIONAL[3]:-YoLLaVA}"
  SEED="${POSITIONAL[4]:-23}"
  if ! [[ "$LISTENER_PORT" =~ ^[0-9]+$ && "$EPOCHS" =~ ^[0-9]+$ && "$SEED" =~ ^[0-9]+$ ]]; then
    echo "error: LISTENER_PORT, EPOCHS and SEED must be whole numbers; got port=$LISTENER_PORT epochs=$EPOCHS" \
         "seed=$SEED (usage: $0 LISTENER_HOST [LISTENER_PORT] [EPOCHS] [DATASET] [SEED] [--flag value ...])" >&2
    exit 2
  fi
  EXP_NAME="${EXP_NAME:-lewis_speaker_${DATASET}_seed_${SEED}}"
  EPOCH_ARGS=(--num_train_epochs "$EPOCHS" --max_steps -1 --seed "$SEED")
fi
EXP_NAME="${EXP_NAME:-lewis_speaker}"
MODEL="${MODEL:-runs/tiny/qwen2_5_vl}"
LISTENER_MODEL="${LISTENER_MODEL:-$MODEL}"
IMAGES="${IMAGES:-data/demo/images}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
DATA="${DATA:-$OUTPUT_DIR/data/train.jsonl}"
LISTENER_HOST="${LISTENER_HOST:-127.0.0.1}"
LISTENER_PORT="${LISTENER_PORT:-$("$PYTHON" -c 'from vlm_grpo.serve.threaded import free_port; print(free_port())')}"
LISTENER_DEVICE="${LISTENER_DEVICE:-}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-300}"

MODELS=("$MODEL")
if [ -z "$EXTERNAL_LISTENER" ]; then MODELS+=("$LISTENER_MODEL"); fi
for model_dir in "${MODELS[@]}"; do
  if [ ! -f "$model_dir/config.json" ]; then
    "$PYTHON" -m vlm_grpo.testing.tiny --family qwen2_5_vl --out "$model_dir"
  fi
done
DATA_ARGS=()
for arg in "$@"; do
  if [ "$arg" = --dataset_name ] || [[ "$arg" == --dataset_name=* ]]; then DATA_ARGS=(--data_file_paths ""); fi
done
if [ "${#DATA_ARGS[@]}" -eq 0 ] && [ ! -f "$DATA" ]; then
  "$PYTHON" -m vlm_grpo.data.lewis --images "$IMAGES" --out "$DATA" --rows "${ROWS:-16}" --k "${K:-3}"
fi
mkdir -p "$OUTPUT_DIR"
export DEBUG_MODE="${DEBUG_MODE:-true}"
export LOG_PATH="${LOG_PATH:-$OUTPUT_DIR/lewis_${SLURM_JOB_ID:-local}.json}"

# The listener is reached directly, never through a proxy.
export NO_PROXY="$LISTENER_HOST,localhost,127.0.0.1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"
if [ -n "${LISTENER_TOKEN:-}" ]; then export VLM_GRPO_SERVE_TOKEN="$LISTENER_TOKEN"; fi
export LISTENER_URL="http://$LISTENER_HOST:$LISTENER_PORT"
if [ -n "$EXTERNAL_LISTENER" ]; then
  echo "listener: external, http://$LISTENER_HOST:$LISTENER_PORT (not started or stopped here)"
  if ! "$PYTHON" -m vlm_grpo.serve wait "$LISTENER_URL" --timeout "$HEALTH_TIMEOUT"; then
    echo "error: no listener answers at $LISTENER_URL/health; start it first (python -m vlm_grpo.serve listener" \
         "--host $LISTENER_HOST --port $LISTENER_PORT --model ... --image_root ...)" >&2
    exit 1
  fi
else
  listener_args=(--model "$LISTENER_MODEL" --host "$LISTENER_HOST" --port "$LISTENER_PORT" --image_root "$IMAGES")
  if [ -n "$LISTENER_DEVICE" ]; then listener_args+=(--device "$LISTENER_DEVICE"); fi
  echo "listener: $LISTENER_MODEL on $LISTENER_URL (log: $OUTPUT_DIR/listener.log)"
  "$PYTHON" -m vlm_grpo.serve listener "${listener_args[@]}" >"$OUTPUT_DIR/listener.log" 2>&1 &
  LISTENER_PID=$!

  stop_listener() {
    local status=$?
    if kill -0 "$LISTENER_PID" 2>/dev/null; then
      kill -TERM "$LISTENER_PID" 2>/dev/null || true
      for _ in $(seq 1 50); do
        kill -0 "$LISTENER_PID" 2>/dev/null || break
        sleep 0.2
      done
      kill -KILL "$LISTENER_PID" 2>/dev/null || true
    fi
    wait "$LISTENER_PID" 2>/dev/null || true
    echo "listener (pid $LISTENER_PID) stopped"
    exit "$status"
  }
  trap stop_listener EXIT
  trap 'exit 130' INT TERM

  if ! "$PYTHON" -m vlm_grpo.serve wait "$LISTENER_URL" --timeout "$HEALTH_TIMEOUT" --pid "$LISTENER_PID"; then
    echo "The listener did not come up; the end of its log:" >&2
    tail -n 40 "$OUTPUT_DIR/listener.log" >&2 || true
    exit 1
  fi
fi

if [ "${#DATA_ARGS[@]}" -gt 0 ]; then DATA="(--dataset_name)"; fi
launch --config configs/lewis_speaker.yaml "${EPOCH_ARGS[@]}" "${DATA_ARGS[@]}" "$@"
remove_checkpoints "$OUTPUT_DIR"
