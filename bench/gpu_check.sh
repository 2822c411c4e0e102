#!/usr/bin/env bash
# The device check: the CUDA paths of train.py, tune_batch.py and validate.py on one GPU, in a few minutes.
#
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [--only PART,...]   (PYTHON=/path/to/python: the interpreter)
#
# Nothing is downloaded: the data are generated shapes (timm_ext.synthetic_data), models start from random init.
# Parts, each with its own time limit:
#   data          25,800 training and 4,200 validation images, 64 px (resized to 224 by the loaders)
#   tune max      tune_batch.py resnet50 224 px --amp --mem-budget 0.5 --select max: probe, then become train.py at
#                 the chosen micro-batch (one epoch, the same samples as the -b 128 run): samples/s
#   tune tput     the same probe with --select throughput (--dry-run): its trial table and choice
#   train b128    train.py at stock's default -b 128: samples/s, and the speed-up of the tuned micro-batch over it
#   validate      validate.py --retry -b 4096 under a CUDA memory fraction (the probe must step down)
#   oom-recover   train.py -b 512 --oom-recover under a memory fraction that forces a split
#   noise fp16    train.py --log-noise-scale with float16 AMP (GradScaler), accumulation 4
#   bench peak    a probe trial's peak with cuDNN's benchmark search inside / outside the measured window
#   stop cost     samples/s with and without the old per-update stop flag (all-reduce read on the host)
#   sticky error  a trial that breaks the CUDA context: one error trial, no second raise from the cleanup
#   estimate      the CUDA memory estimate against max_memory_reserved of real trials measured as the probe measures
#                 (cuDNN's benchmark search before the window), and the largest batch that really holds under a
#                 12 GiB set_per_process_memory_fraction, searched from the prediction (bench/bench_estimate.py;
#                 alone, --only estimate, about 2 minutes)
#   snapshot      validate.py --estimate's predicted memory snapshot (resnet50, 24 GiB) against the real one of the
#                 same forward under the memory the plan counted on: peaks side by side, _memory_viz compare
#                 (bench/snapshot_check.py)
# Samples/s come from the wall clock between train.py's progress lines (each one syncs the GPU), after the first
# two. One summary table at the end; the exit status is 1 if any part failed. --dry-run prints every command and
# runs nothing; --only runs the parts named (their names as in the table). Logs and outputs go to DIR (default:
# output/gpu_check).
set -u -o pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$REPO/output/gpu_check"
DRY_RUN=0
ONLY=''
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT="$2"; shift ;;
    --only) ONLY=",$2,"; shift ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
else PY="$(command -v python3)"; fi

DATA="$OUT/data"
RUNS="$OUT/runs"
TRAIN_PER_CLASS=8600   # x 3 classes: 201 updates at -b 128
VAL_PER_CLASS=1400     # x 3 classes: 4200 >= the 4096 validate.py is asked for
MODEL=(--model resnet50 --img-size 224 --num-classes 3 --amp)
LOADER=(-j 14 --pin-mem --no-aug)  # the loader must outpace the GPU, or samples/s measure the CPU
ONE_EPOCH=(--epochs 1 --val-split '' --warmup-epochs 0)
# run a script under a CUDA memory fraction: argv = fraction script args...
FRACTION='import os, runpy, sys, torch; torch.cuda.set_per_process_memory_fraction(float(sys.argv[1])); '
FRACTION+='sys.argv = sys.argv[2:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); '
FRACTION+='runpy.run_path(sys.argv[0], run_name="__main__")'
# write the data set: argv = repo folder, data folder
GENERATE='import sys; sys.path.insert(0, sys.argv[1]); from timm_ext.synthetic_data import make_image_folder as m; '
GENERATE+="m(sys.argv[2], 64, $TRAIN_PER_CLASS, splits=('train',)); "
GENERATE+="m(sys.argv[2], 64, $VAL_PER_CLASS, splits=('validation',))"

declare -a ROWS=()
FAILED=0

row() {  # part status seconds result
  [ "$SKIPPED" = 1 ] && return 0
  ROWS+=("$(printf '%-12s %-6s %6s  %s' "$1" "$2" "$3" "$4")")
  [ "$2" = ok ] || [ "$2" = '-' ] || FAILED=1
}

# run NAME LIMIT_S CMD...: print the command; unless --dry-run, run it (unbuffered) with its output, each line
# prefixed by the time it arrived, in $OUT/NAME.log; ELAPSED is its wall time
SKIPPED=0
run() {
  local name="$1" limit="$2"
  shift 2
  SKIPPED=0
  if [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; then SKIPPED=1; return 0; fi
  printf '+ '; printf '%q ' "$@"; printf '\n'
  [ "$DRY_RUN" = 1 ] && return 0
  local start=$SECONDS
  PYTHONUNBUFFERED=1 timeout --kill-after=20 "$limit" "$@" 2>&1 | "$PY" -u -c '
import sys, time
for line in sys.stdin:
    sys.stdout.write(f"{time.time():.3f} {line}")
' > "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  ELAPSED=$((SECONDS - start))
  [ "$rc" = 124 ] && echo "  $name: stopped at its limit of ${limit}s" >&2
  return "$rc"
}

# samples/s of a train.py log: samples between the 3rd and the last progress line over the wall time between them
rate() {  # log micro-batch accumulation
  "$PY" - "$@" <<'EOF'
import re, sys
path, batch, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
marks = [(float(m[1]), int(m[2])) for m in (re.match(r'(\S+) .*Train: \d+ \[\s*(\d+)/', line) for line in open(path))
         if m]
if len(marks) < 4:
    sys.exit(f'only {len(marks)} progress lines')
(t0, u0), (t1, u1) = marks[2], marks[-1]
print(f'{(u1 - u0) * batch * accum / (t1 - t0):.0f}')
EOF
}

yaml_value() {  # file key
  "$PY" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"
}

trial_count() { grep -c '^[0-9.]*   batch ' "$1" || true; }  # the training trials (eval ones are 'eval batch')

show_trials() {  # log title: the probe's trial table (printed once, a line per trial as it ran)
  echo "== $2"
  grep '^[0-9.]*   \(eval \)\?batch ' "$1" | cut -d' ' -f2-
}

if [ "$DRY_RUN" = 0 ]; then
  mkdir -p "$OUT" || exit 1
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check.sh: error: no CUDA device visible to $PY; this check needs one GPU" >&2
    exit 2
  fi
fi

# ---- data -----------------------------------------------------------------------------------------------------------
if run data 120 "$PY" -c "$GENERATE" "$REPO" "$DATA"; then
  IMAGES="$((3 * TRAIN_PER_CLASS)) train / $((3 * VAL_PER_CLASS)) validation images, 64 px"
  [ "$DRY_RUN" = 1 ] || row data ok "$ELAPSED" "$IMAGES"
else
  row data FAIL "$ELAPSED" "see $OUT/data.log"
fi

# ---- tune_batch --select max, then the training it becomes -----------------------------------------------------------
TUNE=("$PY" "$REPO/tune_batch.py" --data-dir "$DATA" "${MODEL[@]}" --mem-budget 0.5 --probe-start 64 --no-cache)
TUNED_RATE=''
if run tune_max 300 "${TUNE[@]}" --select max --tuned-config "$OUT/tune-max.yaml" "${LOADER[@]}" "${ONE_EPOCH[@]}" \
    --log-interval 2 --output "$RUNS" --experiment tuned; then
  [ "$DRY_RUN" = 1 ] && echo "#   which then becomes: $PY $REPO/train.py -c $OUT/tune-max.yaml (os.execv, same process)"
  if [ "$DRY_RUN" = 0 ]; then
    TUNED_B=$(yaml_value "$OUT/tune-max.yaml" batch_size)
    if TUNED_RATE=$(rate "$OUT/tune_max.log" "$TUNED_B" 1); then
      TRIALS=$(trial_count "$OUT/tune_max.log")
      row 'tune max' ok "$ELAPSED" "micro-batch $TUNED_B ($TRIALS trials); trained at $TUNED_RATE samples/s"
    else
      row 'tune max' FAIL "$ELAPSED" "micro-batch $TUNED_B, but no samples/s: $TUNED_RATE"; TUNED_RATE=''
    fi
  fi
else
  row 'tune max' FAIL "$ELAPSED" "see $OUT/tune_max.log"
fi

# ---- tune_batch --select throughput ----------------------------------------------------------------------------------
if run tune_tput 300 "${TUNE[@]}" --select throughput --tuned-config "$OUT/tune-throughput.yaml" --dry-run; then
  if [ "$DRY_RUN" = 0 ]; then
    TPUT_B=$(yaml_value "$OUT/tune-throughput.yaml" batch_size)
    row 'tune tput' ok "$ELAPSED" "micro-batch $TPUT_B ($(trial_count "$OUT/tune_tput.log") trials)"
  fi
else
  row 'tune tput' FAIL "$ELAPSED" "see $OUT/tune_tput.log"
fi

# ---- train.py at stock's -b 128 --------------------------------------------------------------------------------------
if run train_b128 240 "$PY" "$REPO/train.py" --data-dir "$DATA" "${MODEL[@]}" -b 128 "${LOADER[@]}" "${ONE_EPOCH[@]}" \
    --log-interval 10 --output "$RUNS" --experiment b128; then
  if [ "$DRY_RUN" = 0 ]; then
    if STOCK_RATE=$(rate "$OUT/train_b128.log" 128 1); then
      row 'train b128' ok "$ELAPSED" "$STOCK_RATE samples/s"
      if [ -n "$TUNED_RATE" ]; then
        RATIO=$("$PY" -c 'import sys; print(f"{float(sys.argv[1]) / float(sys.argv[2]):.2f}x")' "$TUNED_RATE" \
          "$STOCK_RATE")
        row speed-up - - "$RATIO samples/s at micro-batch $TUNED_B over -b 128 (the seed promised 3x)"
      fi
    else
      row 'train b128' FAIL "$ELAPSED" "no samples/s: $STOCK_RATE"
    fi
  fi
else
  row 'train b128' FAIL "$ELAPSED" "see $OUT/train_b128.log"
fi

# ---- validate.py --retry -b 4096 under a memory fraction -------------------------------------------------------------
if run validate 240 "$PY" -c "$FRACTION" 0.05 "$REPO/validate.py" --data-dir "$DATA" --model resnet50 --img-size 224 \
    --amp --checkpoint "$RUNS/b128/last.pth.tar" --retry -b 4096 -j 14; then
  if [ "$DRY_RUN" = 0 ]; then
    PROBED=$(grep -o 'Batch-size probe: .*' "$OUT/validate.log" | tail -1)
    if grep -Eq 'Batch-size probe: .*[0-9]+ OOM' "$OUT/validate.log"; then  # not 'no OOM'
      row validate ok "$ELAPSED" "${PROBED#Batch-size probe: }"
    else
      row validate FAIL "$ELAPSED" "the fraction did not bind: ${PROBED:-no probe line}"
    fi
  fi
else
  row validate FAIL "$ELAPSED" "see $OUT/validate.log"
fi

# ---- --oom-recover under a memory fraction that forces a split -------------------------------------------------------
if run oom_recover 240 "$PY" -c "$FRACTION" 0.06 "$REPO/train.py" --data-dir "$DATA" "${MODEL[@]}" -b 512 \
    --oom-recover "${LOADER[@]}" "${ONE_EPOCH[@]}" --log-interval 10 --output "$RUNS" --experiment oom; then
  if [ "$DRY_RUN" = 0 ]; then
    SPLITS=$(grep -o 'micro-batch [0-9]* -> [0-9]*' "$OUT/oom_recover.log" | cut -d' ' -f2- | paste -sd ',' -)
    if [ -n "$SPLITS" ]; then
      row oom-recover ok "$ELAPSED" "finished after splits ${SPLITS//,/, }"
    else
      row oom-recover FAIL "$ELAPSED" "finished, but the fraction forced no split"
    fi
  fi
else
  row oom-recover FAIL "$ELAPSED" "see $OUT/oom_recover.log"
fi

# ---- --log-noise-scale with float16 AMP -----------------------------------------------------------------------------
if run noise_fp16 240 "$PY" "$REPO/train.py" --data-dir "$DATA" "${MODEL[@]}" --amp-dtype float16 -b 64 \
    --grad-accum-steps 4 --log-noise-scale "${LOADER[@]}" "${ONE_EPOCH[@]}" --log-interval 20 --output "$RUNS" \
    --experiment noise; then
  if [ "$DRY_RUN" = 0 ]; then
    CSV="$RUNS/noise/noise_scale.csv"
    if [ -f "$CSV" ]; then
      READING=$(tail -1 "$CSV" | cut -d, -f2,5 | { IFS=, read -r b pairs; printf 'B_simple %.0f from %s batch pairs' \
        "$b" "$pairs"; })
      row 'noise fp16' ok "$ELAPSED" "$READING"
    else
      row 'noise fp16' FAIL "$ELAPSED" "no $CSV"
    fi
  fi
else
  row 'noise fp16' FAIL "$ELAPSED" "see $OUT/noise_fp16.log"
fi

# ---- the CUDA defects only a GPU shows (bench/cuda_defects.py; each part its own process) ---------------------------
for PART in 'bench peak:peak:300' 'stop cost:stop-cost:240' 'sticky error:sticky-error:120'; do
  IFS=: read -r LABEL CHECK LIMIT <<< "$PART"
  LOG="cuda_${CHECK//-/_}"
  if run "$LOG" "$LIMIT" "$PY" "$REPO/bench/cuda_defects.py" "$CHECK"; then
    [ "$DRY_RUN" = 1 ] || row "$LABEL" ok "$ELAPSED" "$(grep -o 'RESULT: .*' "$OUT/$LOG.log" | tail -1 | cut -c9-)"
  else
    row "$LABEL" FAIL "$ELAPSED" "$(grep -o 'RESULT: .*' "$OUT/$LOG.log" 2>/dev/null | tail -1 | cut -c9-) see $OUT/$LOG.log"
  fi
done

# ---- the memory estimate against the allocator (bench/bench_estimate.py --device cuda) ----------------------------
if run estimate 240 "$PY" "$REPO/bench/bench_estimate.py" --device cuda; then
  [ "$DRY_RUN" = 1 ] || row estimate ok "$ELAPSED" "$(grep -o 'RESULT: .*' "$OUT/estimate.log" | tail -1 | cut -c9-)"
else
  row estimate FAIL "$ELAPSED" "see $OUT/estimate.log"
fi

# ---- the predicted memory snapshot against the real one (bench/snapshot_check.py) --------------------------------
if run snapshot 180 "$PY" "$REPO/bench/snapshot_check.py" --out "$OUT/snapshot"; then
  [ "$DRY_RUN" = 1 ] || row snapshot ok "$ELAPSED" "$(grep -o 'RESULT: .*' "$OUT/snapshot.log" | tail -1 | cut -c9-)"
else
  row snapshot FAIL "$ELAPSED" "$(grep -o 'RESULT: .*' "$OUT/snapshot.log" 2>/dev/null | tail -1 | cut -c9-) see $OUT/snapshot.log"
fi

[ "$DRY_RUN" = 1 ] && exit 0
show_trials "$OUT/tune_max.log" 'tune_batch.py --select max'
show_trials "$OUT/tune_tput.log" 'tune_batch.py --select throughput'
echo
echo "== gpu_check on $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))'), logs in $OUT"
printf '%-12s %-6s %6s  %s\n' part status s result
printf '%s\n' "${ROWS[@]}"
exit "$FAILED"
