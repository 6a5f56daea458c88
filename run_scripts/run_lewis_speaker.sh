#!/usr/bin/env bash
# Lewis game: train a speaker with GRPO against a listener model served over HTTP.
#   1. starts the listener service (python -m vlm_grpo.serve listener) in the background on loopback,
#   2. waits (bounded) until its /health answers,
#   3. trains the speaker with the rewards listener + format_speaker (<thinking><coarse><detailed>) + one_sentence
#      (configs/lewis_speaker.yaml), with LISTENER_URL pointing at the service,
#   4. stops the service when training ends, fails or is interrupted.
#
#   bash run_scripts/run_lewis_speaker.sh                 # CPU: tiny offline models (built if missing), data/demo images
#   MODEL=/ckpt/speaker LISTENER_MODEL=/ckpt/listener IMAGES=/data/perva NPROC=4 LISTENER_DEVICE=cuda:4 \
#     CUDA_VISIBLE_DEVICES=0,1,2,3,4 bash run_scripts/run_lewis_speaker.sh --max_steps 500
#
# Environment (defaults in brackets): MODEL [runs/tiny/qwen2_5_vl], LISTENER_MODEL [$MODEL], IMAGES
# [data/demo/images], DATA [$OUTPUT_DIR/data/train.jsonl, generated from IMAGES when missing: ROWS=16 games of
# K=3 candidates], OUTPUT_DIR [runs/$EXP_NAME], LISTENER_HOST [127.0.0.1], LISTENER_PORT [a free port],
# LISTENER_DEVICE [cuda if present, else cpu], LISTENER_TOKEN [none; also handed to the service],
# HEALTH_TIMEOUT [300 s], NPROC, MASTER_PORT, DEEPSPEED, RESUME, PYTHON. Extra arguments go to the trainer.
# The listener's limits come from INFERENCE_CONCURRENCY, INFERENCE_ACQUIRE_TIMEOUT, LISTENER_BATCH_SIZE; the
# client's from LISTENER_TIMEOUT, LISTENER_CHUNK_SIZE, LISTENER_MAX_RETRIES, LISTENER_BACKOFF_FACTOR, ...
source "$(dirname "$0")/_common.sh"
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

for model_dir in "$MODEL" "$LISTENER_MODEL"; do
  if [ ! -f "$model_dir/config.json" ]; then
    "$PYTHON" -m vlm_grpo.testing.tiny --family qwen2_5_vl --out "$model_dir"
  fi
done
if [ ! -f "$DATA" ]; then
  "$PYTHON" -m vlm_grpo.serve.lewis --images "$IMAGES" --out "$DATA" --rows "${ROWS:-16}" --k "${K:-3}"
fi
mkdir -p "$OUTPUT_DIR"

# The listener is reached directly, never through a proxy.
export NO_PROXY="$LISTENER_HOST,localhost,127.0.0.1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"
if [ -n "${LISTENER_TOKEN:-}" ]; then export VLM_GRPO_SERVE_TOKEN="$LISTENER_TOKEN"; fi
listener_args=(--model "$LISTENER_MODEL" --host "$LISTENER_HOST" --port "$LISTENER_PORT" --image_root "$IMAGES")
if [ -n "$LISTENER_DEVICE" ]; then listener_args+=(--device "$LISTENER_DEVICE"); fi

echo "listener: $LISTENER_MODEL on http://$LISTENER_HOST:$LISTENER_PORT (log: $OUTPUT_DIR/listener.log)"
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

if ! "$PYTHON" -m vlm_grpo.serve wait "http://$LISTENER_HOST:$LISTENER_PORT" \
    --timeout "$HEALTH_TIMEOUT" --pid "$LISTENER_PID"; then
  echo "The listener did not come up; the end of its log:" >&2
  tail -n 40 "$OUTPUT_DIR/listener.log" >&2 || true
  exit 1
fi

export LISTENER_URL="http://$LISTENER_HOST:$LISTENER_PORT"
launch --config configs/lewis_speaker.yaml "$@"
