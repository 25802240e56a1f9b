#!/usr/bin/env bash
# The README's main job: on a fresh machine (2 CPU cores are enough), set up the environment and
# pretrain a tiny Stable LatentMoE with Quantile Balancing across 2 processes with expert
# parallelism (EP2) and Megatron's distributed optimizer, on the shipped corpus and tokenizer;
# save a distributed checkpoint (torch_dist; optimizer state fully reshardable: a resume with
# another TP/EP/PP layout keeps the Adam moments); print a summary showing the loss went down and
# the balance; draw the expert loads;
# export to HF (logits verified against Megatron) and generate a line of text from the export.
#
#   bash examples/main_job.sh
#
# Env: OUT (default: <repo>/outputs/main_job; wiped at start unless RESUME=1), TRAIN_ITERS (300),
#      NPROC (2), RESUME=1 (continue from OUT's last checkpoint instead of starting over; a new
#      TRAIN_ITERS extends the run, its LR schedule following the new length).
# Outputs: OUT/train.log (full log), OUT/checkpoints/ (torch_dist), OUT/balance.jsonl,
#          OUT/expert_load.png, OUT/tensorboard/, OUT/hf/ (HF export, verified against Megatron).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
t0=$(date +%s)
out="${OUT:-$repo/outputs/main_job}"
iters="${TRAIN_ITERS:-300}"

echo "== [1/4] environment (scripts/setup_env.sh)"
python="$(bash "$repo/scripts/setup_env.sh" | tail -n 1)"
echo "   python: $python"
t_setup=$(date +%s)

resume_flags=()
if [ "${RESUME:-0}" != "1" ]; then
  rm -rf "$out"
else  # continuing, possibly to a new TRAIN_ITERS: the LR schedule follows this run's flags
  resume_flags=(--override-opt_param-scheduler)
fi
mkdir -p "$out"
touch "$out/train.log"
log_start=$(( $(stat -c %s "$out/train.log") + 1 ))  # show only this run's lines
ckpt="$out/checkpoints"

echo "== [2/4] pretraining: tiny Stable LatentMoE + QB, ${NPROC:-2} processes, EP2, $iters iterations"
echo "   (full log: $out/train.log)"
set +e
PYTHON="$python" NPROC="${NPROC:-2}" bash "$repo/examples/run_torchrun.sh" "$repo/examples/args/tiny.sh" \
    --train-iters "$iters" \
    --save "$ckpt" --load "$ckpt" --save-interval 100 \
    --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable \
    --balance-log-file "$out/balance.jsonl" \
    --tensorboard-dir "$out/tensorboard" \
    --data-cache-path "$repo/outputs/cache" \
    --log-interval 10 "${resume_flags[@]}" \
  >> "$out/train.log" 2>&1 &
train_pid=$!
# Show the lines that matter while it runs: our per-iteration [balance] lines, checkpoints, errors
# (not the end-of-run summary: step 3 prints it).
tail -c "+$log_start" -f "$out/train.log" --pid "$train_pid" 2>/dev/null \
  | grep --line-buffered -E '\[balance\]|\[pretrain_stable_latentmoe\]|saving checkpoint|successfully saved|loaded checkpoint|Error|error:|Traceback' \
  | grep --line-buffered -v -E '^  [a-z_0-9]+ \.+ |\] summary: '
wait "$train_pid"
status=$?
set -e
if [ "$status" -ne 0 ]; then
  echo "!! pretraining failed (exit $status); last lines of $out/train.log:" >&2
  tail -n 40 "$out/train.log" >&2
  exit "$status"
fi
t_train=$(date +%s)

echo "== [3/4] summary and expert-load picture"
"$python" "$repo/tools/plot_balance.py" "$out/balance.jsonl" --summary \
    --out "$out/expert_load.png" --title "tiny Stable LatentMoE + Quantile Balancing (EP2, CPU)"
echo "   checkpoint: $ckpt (iteration $(cat "$ckpt/latest_checkpointed_iteration.txt"), torch_dist)"

echo "== [4/4] export to Hugging Face, verify logits, generate"
export PYTHONWARNINGS="ignore::UserWarning,ignore::FutureWarning"  # megatron-core's import-time chatter
"$python" -m megatron_latentmoe.convert export --checkpoint "$ckpt" --output "$out/hf" \
    --overwrite --verify
echo "   generated from the export (32 tokens, sampled at temperature 0.8, seed 0):"
"$python" "$repo/tools/generate_hf.py" "$out/hf" --prompt "In the beginning" --max-new-tokens 32 --sample \
  | sed 's/^/   > /'

t_end=$(date +%s)
echo "== done in $((t_end - t0)) s (setup $((t_setup - t0)) s, training $((t_train - t_setup)) s, rest $((t_end - t_train)) s)"
echo "   picture: $out/expert_load.png   log: $out/train.log   tensorboard: $out/tensorboard"
