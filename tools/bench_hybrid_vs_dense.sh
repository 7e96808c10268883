#!/usr/bin/env bash
# The hybrid-model step against its dense equivalent, and both against transformers, in one run:
# configs/bench/hybrid-h256.json (3 Gated DeltaNet + 1 full-attention layer) and dense-h256.json
# (the same dimensions, every layer full attention), batch 2 x seq 1024, on THREADS threads.
#
# Usage: tools/bench_hybrid_vs_dense.sh [THREADS=2] [STEPS=2] [HARDWARE=cpu]
#   lt bench train --policy keep-all   hybrid (chunked delta rule), dense, hybrid with
#                                      LT_DELTA_FORM=recurrent (the reference form)
#   tools/bench/torch_train.py         transformers training each model (its PyTorch chunked rule)
# each with 1 warm-up step. Prints median step seconds and the ratios: hybrid/dense (issue 16's
# floor: <= 1.0x), recurrent/chunked, lt vs transformers, and lt's predicted step on HARDWARE
# (a built-in name or the TOML of `lt profile --device cpu`). Needs python3 with torch and
# transformers for the baseline rows.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${1:-2}
STEPS=${2:-2}
HARDWARE=${3:-cpu}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
cargo build --release -q -p lt-cli
export RAYON_NUM_THREADS=$THREADS OMP_NUM_THREADS=$THREADS
lscpu | sed -n 's/^Model name:[[:space:]]*/cpu: /p'
run_lt() { # name config [env...]
    local name=$1 cfg=$2
    shift 2
    env "$@" ./target/release/lt bench train --model-config "$cfg" --batch-size 2 --seq-len 1024 --policy keep-all \
        --steps "$STEPS" --warmup 1 --device cpu --threads "$THREADS" --hardware "$HARDWARE" --json 2>/dev/null \
        | tail -n 1 | sed "s/^{/{\"name\":\"$name\",/" >> "$W/rows"
}
run_torch() { # name config
    python3 tools/bench/torch_train.py --make "$W/$1" --config "$2" --seq 1024 --rows 8 2>/dev/null
    python3 tools/bench/torch_train.py --model "$W/$1/model" --data "$W/$1/data.jsonl" --batch 2 --steps "$STEPS" \
        --warmup 1 --threads "$THREADS" 2>/dev/null | tail -n 1 | sed "s/^{/{\"name\":\"$1\",/" >> "$W/rows"
}
run_lt lt-hybrid configs/bench/hybrid-h256.json
run_lt lt-dense configs/bench/dense-h256.json
run_lt lt-hybrid-recurrent configs/bench/hybrid-h256.json LT_DELTA_FORM=recurrent
run_torch torch-hybrid configs/bench/hybrid-h256.json
run_torch torch-dense configs/bench/dense-h256.json
python3 - "$W/rows" <<'PY'
import json, sys
r = {x["name"]: x for x in map(json.loads, open(sys.argv[1]))}
s = {k: v.get("step_seconds", v.get("step_seconds_median")) for k, v in r.items()}
for k in ("lt-hybrid", "lt-dense", "lt-hybrid-recurrent", "torch-hybrid", "torch-dense"):
    pred = r[k].get("predicted_step_seconds")
    extra = f"   predicted {pred:.3f} s ({r[k]['hardware']}), measured/predicted {s[k] / pred:.2f}" if pred else ""
    print(f"{k:<20} {s[k]:8.3f} s/step{extra}")
print(f"hybrid / dense step (lt, chunked):      {s['lt-hybrid'] / s['lt-dense']:.2f}x   (floor <= 1.0x)")
print(f"recurrent / chunked (lt, hybrid):       {s['lt-hybrid-recurrent'] / s['lt-hybrid']:.2f}x")
print(f"lt vs transformers, hybrid (speed):     {s['torch-hybrid'] / s['lt-hybrid']:.2f}x")
print(f"lt vs transformers, dense (speed):      {s['torch-dense'] / s['lt-dense']:.2f}x")
PY
