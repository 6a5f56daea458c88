#!/usr/bin/env bash
# Issue 20, round two: every single-GPU measurement, four jobs side by side on a 4-GPU host (one job per
# card, CUDA_VISIBLE_DEVICES), each comparing ours with vanilla TRL on its own card in its own process
# chain. Run from the repository root on the device after `source benchmarks/device_env.sh`:
#   OUT=/somewhere bash benchmarks/i20_round2.sh            # all four jobs (about 9 minutes)
#   OUT=/somewhere bash benchmarks/i20_round2.sh 3          # one job (on card 0 if there is only one)
#   OUT=/somewhere bash benchmarks/i20_round2.sh 6 7 8      # the measurements still missing (cards 0, 1, 2)
# Files: $OUT/i20[cd]_*.json and logs.tgz (one log per job). Jobs 4 and 5 are the same measurements one at a
# time on one card (side by side, the four jobs slowed each other's CPU work: see RESULTS.md).
set -uo pipefail
cd "$(dirname "$0")"
OUT="${OUT:-/tmp/i20c}"
LIMIT="${LIMIT:-560}"  # seconds per job: whatever finished comes back
mkdir -p "$OUT"
B=(python3 bench_grpo.py --preset qwen2_5_vl_3b --device cuda --vary_prompts 6 --warmup 1 --steps 5)
D=(python3 decode_lengths.py --preset qwen2_5_vl_3b --device cuda)

job0() {  # 448² C128: full fine-tuning and LoRA r64, ours vs vanilla; then the multi-turn tool scenario
  "${B[@]}" --image_sizes 448 --completion_lengths 128 --trainers ours vanilla --out "$OUT/i20c_448_c128.json"
  "${B[@]}" --image_sizes 448 --completion_lengths 128 --trainers ours vanilla --lora_r 64 \
    --out "$OUT/i20c_448_c128_lora64.json"
  python3 bench_tools.py --preset qwen2_5_vl_3b --device cuda --image_sizes 448 --completion_lengths 128 \
    --steps 3 --warmup 1 --out "$OUT/i20c_tools_448_c128.json"
}
job1() {  # 448² C1024 (forced length), ours vs vanilla
  "${B[@]}" --image_sizes 448 --completion_lengths 1024 --trainers ours vanilla --out "$OUT/i20c_448_c1024.json"
}
job2() {  # 896² C128 ours vs vanilla; then 4 and 8 prompts x G=8 per step (ours; 2 prompts is job 0's row)
  "${B[@]}" --image_sizes 896 --completion_lengths 128 --trainers ours vanilla --out "$OUT/i20c_896_c128.json"
  for n in 4 8; do
    "${B[@]}" --image_sizes 448 --completion_lengths 128 --trainers ours --prompts_per_step "$n" \
      --out "$OUT/i20c_448_c128_p$n.json"
  done
}
job3() {  # the decode step alone: fused projections off / on, C128 and C1024, profiles; max-autotune last
  "${D[@]}" --fuse false --profile "$OUT/i20c_decode_nofuse_profile.txt" --out "$OUT/i20c_decode_nofuse.json"
  "${D[@]}" --fuse true --profile "$OUT/i20c_decode_fuse_profile.txt" --out "$OUT/i20c_decode_fuse.json"
  "${D[@]}" --fuse true --new_tokens 1024 --prompt_lengths 330 340 350 --profile "$OUT/i20c_decode_c1024_profile.txt" \
    --out "$OUT/i20c_decode_c1024.json"
  "${D[@]}" --fuse true --compile_mode max-autotune-no-cudagraphs --prompt_lengths 300 307 313 300 \
    --out "$OUT/i20c_decode_autotune.json"
}

job4() {  # one card, one job at a time: the decode step with fusion off / on, then 448² C128 full and LoRA r64
  timeout 110 "${D[@]}" --fuse false --out "$OUT/i20d_decode_nofuse.json"
  timeout 100 "${D[@]}" --fuse true --out "$OUT/i20d_decode_fuse.json"
  "${B[@]}" --image_sizes 448 --completion_lengths 128 --trainers ours vanilla --out "$OUT/i20d_448_c128.json"
  "${B[@]}" --image_sizes 448 --completion_lengths 128 --trainers ours vanilla --lora_r 64 \
    --out "$OUT/i20d_448_c128_lora64.json"
}
job5() {  # one card: 448² C1024 ours vs vanilla
  "${B[@]}" --image_sizes 448 --completion_lengths 1024 --trainers ours vanilla --out "$OUT/i20d_448_c1024.json"
}
# What the eighth session could not measure alone (run side by side: `... i20_round2.sh 6 7 8`, threads split).
job6() {  # issue 17: 2 tool rounds with a returned image each, ours vs vanilla TRL's tool loop
  python3 bench_tools.py --preset qwen2_5_vl_3b --device cuda --image_sizes 448 --completion_lengths 128 \
    --steps 3 --warmup 1 --out "$OUT/i20e_tools_448_c128.json"
}
job7() {  # LoRA r64, ours vs vanilla
  "${B[@]}" --image_sizes 448 --completion_lengths 128 --trainers ours vanilla --lora_r 64 \
    --out "$OUT/i20e_448_c128_lora64.json"
}
job8() {  # 896² C128, ours vs vanilla
  "${B[@]}" --image_sizes 896 --completion_lengths 128 --trainers ours vanilla --out "$OUT/i20e_896_c128.json"
}

# Ninth session, one card, one job at a time (`... i20_round2.sh 9`, then `... 10`).
job9() {  # issue 17's tool loop; then LoRA r64 with dropout (adapters run beside the fused base) vs vanilla
  python3 bench_tools.py --preset qwen2_5_vl_3b --device cuda --image_sizes 448 --completion_lengths 128 \
    --steps 3 --warmup 1 --out "$OUT/i20f_tools_448_c128.json"
  "${B[@]}" --image_sizes 448 --completion_lengths 128 --trainers ours vanilla --lora_r 64 \
    --out "$OUT/i20f_448_c128_lora64.json"
}
job10() {  # 896² C128 vs vanilla; then LoRA r64 without dropout (folded into the fused decode weights), ours only
  "${B[@]}" --image_sizes 896 --completion_lengths 128 --trainers ours vanilla --out "$OUT/i20f_896_c128.json"
  "${B[@]}" --image_sizes 448 --completion_lengths 128 --trainers ours --lora_r 64 --lora_dropout 0 \
    --out "$OUT/i20f_448_c128_lora64_fold.json"
}

job11() {  # issue 17 again, after tool runs kept share_prefill / fast_decode for generation
  python3 bench_tools.py --preset qwen2_5_vl_3b --device cuda --image_sizes 448 --completion_lengths 128 \
    --steps 3 --warmup 1 --out "$OUT/i20g_tools_448_c128.json"
}

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
jobs=("$@")
[ ${#jobs[@]} -eq 0 ] && jobs=(0 1 2 3)
# Jobs side by side share the host: split its cores between them (each torch process otherwise starts a
# thread pool as large as the machine, and the eighth session's side-by-side run slowed everyone's CPU work).
threads=$(( $(nproc) / ${#jobs[@]} )); [ "$threads" -lt 1 ] && threads=1
n=0
for j in "${jobs[@]}"; do
  card=$(( gpus > 1 ? n % gpus : 0 )); n=$((n + 1))
  ( export CUDA_VISIBLE_DEVICES=$card OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads; timeout "$LIMIT" bash -c "$(declare -f "job$j"); $(declare -p B D OUT); job$j" \
      >"$OUT/job$j.log" 2>&1; echo "[i20c] job$j on card $card: rc=$?" ) &
done
wait
grep -h "^\[i20c\]\|^\[bench_tools\]\|^[0-9]*px\|decode_ms_per_token" "$OUT"/job*.log | cut -c1-400 | head -60
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls job*.log) && rm -f "$OUT"/job*.log  # the device returns few files
