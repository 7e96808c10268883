#!/usr/bin/env bash
# `lt train --device wgpu` against `lt train --device cpu` on every fixture family under every policy:
# 4 steps, batch 2 x seq 12, lr 1e-3, as crates/lt-cli/tests/device_wgpu.rs does for a subset (CI runs
# that subset: each wgpu process compiles its kernels again, 10-60 s on lavapipe, so the whole matrix
# would cost CI about 15 minutes). Prints each pair's largest per-step loss difference, relative.
#
#   tools/train_matrix_wgpu.sh [LT]     # LT: an `lt` built with --features wgpu (default target/debug/lt)
#
# Exit code: 0 when every pair agrees within 1e-4 relative at every step, 1 otherwise.
set -u -o pipefail
cd "$(dirname "$0")/.."
LT=${1:-target/debug/lt}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/xdg-runtime-$(id -u)}
mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"

# The per-step losses of one run's metrics.jsonl, one per line.
losses() { sed -n 's/.*"loss":\([-0-9.eE+]*\).*"step":[0-9]*.*/\1/p' "$1"; }

FAILED=0
for name in qwen2-tied-gqa qwen2-untied-mqa qwen3-hd16-gqa qwen3-tied-mqa qwen35-hybrid; do
    for policy in auto keep-all recompute-all megatrain; do
        for device in cpu wgpu; do
            "$LT" train --model "tools/fixtures/models/$name" --data "tools/fixtures/train/$name/train.jsonl" \
                --steps 4 --batch-size 2 --seq-len 12 --lr 1e-3 --policy "$policy" --device "$device" \
                --out "$OUT/$name-$policy-$device" >"$OUT/$name-$policy-$device.log" 2>&1 \
                || { echo "$name $policy $device: lt train failed:"; tail -n 3 "$OUT/$name-$policy-$device.log"; }
        done
        worst=$(paste <(losses "$OUT/$name-$policy-cpu/metrics.jsonl") <(losses "$OUT/$name-$policy-wgpu/metrics.jsonl") |
            awk 'BEGIN { w = -1; n = 0 } NF == 2 { n++; d = ($2 - $1) / $1; if (d < 0) d = -d; if (d > w) w = d }
                 END { if (n == 4) printf "%.2e", w; else print "missing" }')
        verdict=ok
        if [[ $worst == missing ]] || awk -v w="$worst" 'BEGIN { exit !(w > 1e-4) }'; then
            verdict=FAIL
            FAILED=$((FAILED + 1))
        fi
        printf '%-18s %-14s max step loss rel diff %s  %s\n' "$name" "$policy" "$worst" "$verdict"
    done
done
[[ $FAILED -eq 0 ]]
