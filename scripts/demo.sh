#!/usr/bin/env bash
# The main job end to end on the CPU, on a generated dataset (no downloads):
#   probe the largest micro-batch that fits a memory budget -> plan accumulation for a global batch of 64 ->
#   scale the LR -> write a YAML config -> train -> validate the best checkpoint with the probe-first retry.
# Everything goes under ./output/demo. Extra arguments go to tune_batch.py (e.g. --mem-budget 2GiB).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
py=.venv/bin/python
out=output/demo
data="$out/data"
model=test_resnet
size=48

[ -d "$data/train" ] || $py -m timm_ext.synthetic_data "$data" --size $size --per-class 128
rm -rf "$out/train"

echo "== probe -> plan -> LR -> config -> train"
$py tune_batch.py "$data" --model $model --img-size $size --num-classes 3 --device cpu --workers 0 \
  --opt adamw --lr-base 2e-3 --sched cosine --warmup-epochs 1 --epochs 6 --log-interval 5 \
  --mem-budget 72MiB --target-global-batch 64 \
  --tuned-config "$out/tuned.yaml" --output "$out" --experiment train "$@"

echo "== validate the best checkpoint (probe-first --retry from batch 1024)"
$py validate.py "$data" --split validation --model $model --num-classes 3 --img-size $size --device cpu \
  --workers 0 --checkpoint "$out/train/model_best.safetensors" --retry -b 1024 \
  --results-file "$out/validate.json" --results-format json
