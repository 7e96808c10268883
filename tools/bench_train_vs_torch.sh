#!/usr/bin/env bash
# Throughput of `lt train` (ndarray backend) against PyTorch training the same HF model on the same
# batch and CPU threads, measured in the same run, plus lt's measured vs predicted step time.
#   usage: tools/bench_train_vs_torch.sh [threads=2] [steps=8]
# Needs python3 with torch + transformers (for the baseline only) and a release `lt`.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
STEPS=${2:-8}
WARMUP=2
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
cargo build --release -q -p lt-cli
python3 tools/bench/torch_train.py --make "$W" --seq 256 --rows 64 2>/dev/null
TORCH=$(OMP_NUM_THREADS=$THREADS python3 tools/bench/torch_train.py --model "$W/model" --data "$W/data.jsonl" \
  --batch 8 --steps "$STEPS" --warmup $WARMUP --threads "$THREADS" 2>/dev/null | tail -1)
for POLICY in keep-all auto; do
  OUT="$W/lt-$POLICY"
  RAYON_NUM_THREADS=$THREADS ./target/release/lt train --model "$W/model" --data "$W/data.jsonl" --steps $((STEPS + WARMUP)) \
    --batch-size 8 --seq-len 256 --optimizer adamw --lr 1e-5 --no-shuffle --no-packing --policy "$POLICY" \
    --threads "$THREADS" --gpu-memory 8GiB --out "$OUT" > "$OUT.log" 2>&1
  python3 - "$OUT/metrics.jsonl" "$TORCH" "$POLICY" "$WARMUP" "$OUT.log" <<'PY'
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
torch = json.loads(sys.argv[2]); policy = sys.argv[3]; warm = int(sys.argv[4])
rows = rows[warm:]
med = statistics.median(r["step_seconds"] for r in rows)
tok = rows[0]["tokens"]
exp = {k: statistics.median(r["exposed_seconds"][k] for r in rows) for k in ("h2d", "d2h", "nvme", "optimizer")}
log = open(sys.argv[5]).read()
pred = re.search(r"predicted step ([0-9.]+) s", log)
print(json.dumps({"policy": policy, "lt_tokens_per_s": tok / med, "torch_tokens_per_s": torch["tokens_per_s"],
                  "ratio_vs_torch": (tok / med) / torch["tokens_per_s"], "lt_step_seconds_median": med,
                  "predicted_step_seconds": float(pred.group(1)) if pred else None,
                  "measured_exposed_seconds_median": exp}))
PY
done
