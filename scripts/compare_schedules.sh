#!/usr/bin/env bash
# Fine-tuning schedules compared on the demo (split A: data/demo_*.db) and on a second split
# (split B: the demo generator with seed 1), as docs/benchmarks.md reports them.
#
#   bash scripts/compare_schedules.sh [OUT]     (OUT defaults to outputs/schedules; ~40 min; one thread per run,
#                                                 so that the figures do not depend on the core count)
#
# Each run is `finetune.py --config configs/demo.yaml` with one schedule setting changed; the tables
# and curves come from scripts/plot_metrics.py --table.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-outputs/schedules}
python "$here/scripts/make_demo_dataset.py" --out "$out/data_B" --seed 1
declare -A runs=(
  [one_cycle_3e-4]="--lr_schedule one_cycle --lr 3e-4 --ema_decay 0"
  [cosine_3e-4]="--lr_schedule cosine --lr 3e-4 --ema_decay 0"
  [cosine_1e-4]="--lr_schedule cosine --lr 1e-4 --ema_decay 0"
  [cosine_3e-4_ema]="--lr_schedule cosine --lr 3e-4 --ema_decay 0.99"
  [cosine_1e-4_ema]="--lr_schedule cosine --lr 1e-4 --ema_decay 0.99"
  [constant_1e-4]="--lr_schedule constant --lr 1e-4 --ema_decay 0"
)
for split in A B; do
  data=(--train_data_path "$here/data/demo_train.db" --val_data_path "$here/data/demo_val.db")
  [ "$split" = B ] && data=(--train_data_path "$out/data_B/demo_train.db" --val_data_path "$out/data_B/demo_val.db")
  for name in "${!runs[@]}"; do
    # shellcheck disable=SC2086
    python "$here/finetune.py" --config "$here/configs/demo.yaml" "${data[@]}" --checkpoint_path "$here/data/demo_pretrained.ckpt" \
      --output_dir "$out/$split/$name" --overwrite --progress_bar false --num_threads 1 ${runs[$name]} > "$out/$split.$name.log" 2>&1
  done
  python "$here/scripts/plot_metrics.py" "$out/$split"/*/metrics.jsonl -o "$out/curves_$split.png" --table
done
