#!/usr/bin/env bash
# Gradient clipping compared: orb-models 0.4.2/0.5.5's element-wise clamp (gradient_clip_mode: value) against
# 0.7.0's clipping of the global norm (norm), both at 0.5, on the orb-v2 demo, the orb-v3 demo and the narrow
# Cu-Ni target of the replay study (docs/benchmarks.md reports the tables this writes).
#
#   bash scripts/compare_clipping.sh [OUT]     (OUT defaults to outputs/clipping; two runs at a time, one thread
#                                                each, so that the figures do not depend on the core count)
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-outputs/clipping}
mkdir -p "$out"
python "$here/scripts/make_demo_dataset.py" --out "$out/narrow" --metals Cu,Ni --cluster_fraction 0 --seed 31 \
  > "$out/narrow.log" 2>&1
declare -A cases=(
  [demo_v2]="--config $here/configs/demo.yaml"
  [demo_v3]="--config $here/configs/demo_v3.yaml"
  [narrow]="--config $here/configs/demo.yaml --max_epochs 20 --train_data_path $out/narrow/demo_train.db --val_data_path $out/narrow/demo_val.db"
)
for name in "${!cases[@]}"; do
  for mode in value norm; do
    # shellcheck disable=SC2086
    python "$here/finetune.py" ${cases[$name]} --gradient_clip_mode "$mode" --gradient_clip_val 0.5 \
      --output_dir "$out/$name/$mode" --overwrite --progress_bar false --num_threads 1 > "$out/$name.$mode.log" 2>&1 &
  done
  wait
  python "$here/scripts/plot_metrics.py" "$out/$name"/*/metrics.jsonl -o "$out/curves_$name.png" --table \
    > "$out/table_$name.md"
done
