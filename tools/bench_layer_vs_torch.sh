#!/usr/bin/env bash
# One decoder layer, LazyTrain-rs vs transformers, measured in the same run on the same threads.
#
# Usage: tools/bench_layer_vs_torch.sh [CONFIG] [LAYER] [SEQ] [THREADS] [ROUNDS]
#   defaults: configs/models/qwen3.6-27b.json linear 1024 2 2
#
# Builds `lt` in release mode, then ROUNDS interleaved rounds, each running once, back to back:
#   lt bench layer --delta-form chunked    (LAYER linear only: and --delta-form recurrent, when
#                                           RECURRENT=1; it is ~5-8x slower)
#   tools/bench/torch_layer.py             (transformers' layer; its pure-PyTorch chunked delta rule)
# each with 1 untimed warm-up and STEPS (2) timed forward+backward rounds at batch 1, and prints the
# medians with lt/transformers ratios. Ratios, not absolute figures, are what to quote on a shared
# machine. Needs: cargo, python3 with torch and transformers (CPU); a 27B layer takes ~4 GiB.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${1:-configs/models/qwen3.6-27b.json}
LAYER=${2:-linear}
SEQ=${3:-1024}
THREADS=${4:-2}
ROUNDS=${5:-2}
STEPS=${STEPS:-2}

cargo build --release -p lt-cli >&2
LT=target/release/lt
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
export RAYON_NUM_THREADS=$THREADS
lscpu | sed -n 's/^Model name:[[:space:]]*/cpu: /p' >&2

for r in $(seq 1 "$ROUNDS"); do
    echo "round $r/$ROUNDS" >&2
    forms="chunked"
    [[ $LAYER == linear && ${RECURRENT:-0} == 1 ]] && forms="chunked recurrent"
    for f in $forms; do
        "$LT" bench layer --model-config "$CONFIG" --layer "$LAYER" --seq-len "$SEQ" --delta-form "$f" \
            --steps "$STEPS" --warmup 1 --json | tail -n 1 | sed "s/^{/{\"impl\":\"lt-$f\",/" >> "$OUT"
    done
    python3 tools/bench/torch_layer.py --config "$CONFIG" --layer "$LAYER" --seq "$SEQ" --threads "$THREADS" \
        --steps "$STEPS" --warmup 1 2>/dev/null | tail -n 1 >> "$OUT"
done

python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
groups = {}
for r in rows:
    groups.setdefault(r["impl"], []).append(r)
med = {k: (statistics.median(x["fwd_seconds"] for x in v), statistics.median(x["fwd_bwd_seconds"] for x in v))
       for k, v in groups.items()}
base = med.get("transformers")
first = rows[0]
print(f"{first.get('model_config', '?')} layer {first['layer']} ({first['layer_type']}), batch {first['batch_size']} x "
      f"seq {first['seq_len']}, same run, medians over rounds")
print(f"{'impl':<14} {'runs':>4} {'fwd s':>9} {'fwd+bwd s':>10} {'speed vs transformers (fwd, fwd+bwd)':>38}")
for k, (f, fb) in sorted(med.items(), key=lambda kv: kv[1][1]):
    ratio = f"{base[0] / f:.2f}x, {base[1] / fb:.2f}x" if base else "n/a"
    print(f"{k:<14} {len(groups[k]):>4} {f:>9.3f} {fb:>10.3f} {ratio:>38}")
PY
