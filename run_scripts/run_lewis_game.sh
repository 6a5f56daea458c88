#!/usr/bin/env bash
# Lewis game loop: speaker and listener take turns; each is trained with GRPO against the other one served through
# vlm-grpo-serve. Round r:
#   1. speaker phase  (run_lewis_speaker.sh): serve the current listener, wait for /health, train the speaker STEPS
#      steps (rewards listener + format_speaker + one_sentence), save round_r/speaker, stop the listener;
#   2. listener phase: serve the new speaker, have it describe every game's target
#      (python -m vlm_grpo.data.lewis_listener), stop it, train the listener STEPS steps on picking the target among
#      the K candidates (configs/lewis_listener.yaml: accuracy (mcq) + format), save round_r/listener;
#   3. swap: the next round starts from these two checkpoints (a LoRA output is merged first).
#
#   bash run_scripts/run_lewis_game.sh                       # CPU: tiny offline models, data/demo images, 2 rounds
#   SPEAKER_MODEL=/ckpt/qwen2-vl-7b LISTENER_MODEL=/ckpt/qwen2-vl-7b CONCEPTS=/data/PerVA IMAGES=/data/PerVA \
#     ROUNDS=4 STEPS=200 NPROC=4 LISTENER_DEVICE=cuda:4 SPEAKER_DEVICE=cuda:4 \
#     bash run_scripts/run_lewis_game.sh --use_peft true --lo_rank 64 --lo_alpha 128 --lo_dropout 0.001
#
# Environment (defaults in brackets): SPEAKER_MODEL [runs/tiny/qwen2_5_vl, built if missing], LISTENER_MODEL
# [$SPEAKER_MODEL], IMAGES [data/demo/images: the image root], CONCEPTS [none: games over IMAGES; else a concept
# folder ROOT/<concept>/<image> or a JSONL of {image, concept}: same-concept distractors], GAMES
# [$OUTPUT_DIR/games.jsonl, built when missing: ROWS=16 games of K=3], ROUNDS [2], STEPS [2 per phase], OUTPUT_DIR
# [runs/$EXP_NAME], LOG_PATH [$OUTPUT_DIR/lewis_predictions.json: one JSON line per game the listener answered;
# DEBUG_MODE=true rollout logs go to their own files], intermediate checkpoints are removed after each phase
# (KEEP_CHECKPOINTS=1 keeps them),
# SPEAKER_DEVICE / LISTENER_DEVICE [cuda if present, else cpu], HEALTH_TIMEOUT [300 s], NPROC, MASTER_PORT,
# DEEPSPEED, PYTHON. Extra arguments go to both trainers.
source "$(dirname "$0")/_common.sh"
EXP_NAME="${EXP_NAME:-lewis_game}"
SPEAKER_MODEL="${SPEAKER_MODEL:-runs/tiny/qwen2_5_vl}"
LISTENER_MODEL="${LISTENER_MODEL:-$SPEAKER_MODEL}"
IMAGES="${IMAGES:-data/demo/images}"
CONCEPTS="${CONCEPTS:-}"
OUTPUT_DIR="${OUTPUT_DIR:-runs/$EXP_NAME}"
GAMES="${GAMES:-$OUTPUT_DIR/games.jsonl}"
ROUNDS="${ROUNDS:-2}"
STEPS="${STEPS:-2}"
HEALTH_TIMEOUT="${HEALTH_TIMEOUT:-300}"
export LOG_PATH="${LOG_PATH:-$OUTPUT_DIR/lewis_predictions.json}"
GAME_DIR="$OUTPUT_DIR"

for model_dir in "$SPEAKER_MODEL" "$LISTENER_MODEL"; do
  if [ ! -f "$model_dir/config.json" ]; then
    "$PYTHON" -m vlm_grpo.testing.tiny --family qwen2_5_vl --out "$model_dir"
  fi
done
if [ ! -f "$GAMES" ]; then
  if [ -n "$CONCEPTS" ]; then
    "$PYTHON" -m vlm_grpo.data.lewis --concepts "$CONCEPTS" --image_root "$IMAGES" --out "$GAMES" \
      --rows "${ROWS:-16}" --k "${K:-3}" --distractors "${DISTRACTORS:-same_concept}"
  else
    "$PYTHON" -m vlm_grpo.data.lewis --images "$IMAGES" --out "$GAMES" --rows "${ROWS:-16}" --k "${K:-3}"
  fi
fi
echo "================ Lewis game: $ROUNDS rounds of $STEPS steps per phase ================"
echo "SPEAKER_MODEL  = $SPEAKER_MODEL"
echo "LISTENER_MODEL = $LISTENER_MODEL"
echo "GAMES          = $GAMES (images under $IMAGES)"
echo "OUTPUT_DIR     = $GAME_DIR"
echo "LOG_PATH       = $LOG_PATH"

# A checkpoint the next phase can load and serve: a LoRA adapter is merged into its base first.
usable() {
  if [ -f "$1/adapter_config.json" ]; then
    "$PYTHON" -m vlm_grpo.merge_lora --adapter "$1" --output_dir "$1-merged" -y >&2
    echo "$1-merged"
  else
    echo "$1"
  fi
}

export NO_PROXY="localhost,127.0.0.1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"
SPEAKER_PID=""
stop_speaker() {
  if [ -n "$SPEAKER_PID" ] && kill -0 "$SPEAKER_PID" 2>/dev/null; then
    kill -TERM "$SPEAKER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$SPEAKER_PID" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL "$SPEAKER_PID" 2>/dev/null || true
    wait "$SPEAKER_PID" 2>/dev/null || true
    echo "speaker (pid $SPEAKER_PID) stopped"
  fi
  SPEAKER_PID=""
}
trap 'status=$?; stop_speaker; exit $status' EXIT
trap 'exit 130' INT TERM

speaker="$SPEAKER_MODEL"
listener="$LISTENER_MODEL"
for round in $(seq 1 "$ROUNDS"); do
  dir="$GAME_DIR/round_$round"
  mkdir -p "$dir"
  echo "---------------- round $round/$ROUNDS: speaker phase (listener $listener served) ----------------"
  EXP_NAME="lewis_game_r${round}_speaker" MODEL="$speaker" LISTENER_MODEL="$listener" DATA="$GAMES" IMAGES="$IMAGES" \
    OUTPUT_DIR="$dir/speaker" bash run_scripts/run_lewis_speaker.sh --max_steps "$STEPS" "$@"
  speaker="$(usable "$dir/speaker")"

  echo "---------------- round $round/$ROUNDS: listener phase (speaker $speaker served) ----------------"
  port="$("$PYTHON" -c 'from vlm_grpo.serve.threaded import free_port; print(free_port())')"
  speaker_args=(--model "$speaker" --host 127.0.0.1 --port "$port" --image_root "$IMAGES")
  if [ -n "${SPEAKER_DEVICE:-}" ]; then speaker_args+=(--device "$SPEAKER_DEVICE"); fi
  "$PYTHON" -m vlm_grpo.serve speaker "${speaker_args[@]}" --max_new_tokens "${SPEAKER_MAX_NEW_TOKENS:-64}" \
    >"$dir/speaker_service.log" 2>&1 &
  SPEAKER_PID=$!
  if ! "$PYTHON" -m vlm_grpo.serve wait "http://127.0.0.1:$port" --timeout "$HEALTH_TIMEOUT" --pid "$SPEAKER_PID"; then
    echo "The speaker service did not come up; the end of its log:" >&2
    tail -n 40 "$dir/speaker_service.log" >&2 || true
    exit 1
  fi
  "$PYTHON" -m vlm_grpo.serve.lewis_listener --games "$GAMES" --speaker_url "http://127.0.0.1:$port" \
    --out "$dir/listener_rows.jsonl"
  stop_speaker
  EXP_NAME="lewis_game_r${round}_listener" MODEL="$listener" DATA="$dir/listener_rows.jsonl" OUTPUT_DIR="$dir/listener"
  # LOG_PATH is the speaker games' prediction log; the listener phase's DEBUG_MODE rollouts go to their own file
  LOG_PATH="$dir/listener/rollouts.jsonl" launch --config configs/lewis_listener.yaml --max_steps "$STEPS" "$@"
  remove_checkpoints "$dir/listener"
  listener="$(usable "$dir/listener")"
done
echo "[lewis-game] $ROUNDS rounds done; speaker: $speaker; listener: $listener; predictions: $LOG_PATH"
