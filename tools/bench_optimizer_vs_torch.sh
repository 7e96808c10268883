#!/usr/bin/env bash
# Host optimizer throughput, LazyTrain-rs vs PyTorch and bitsandbytes, measured in the same run.
#
# Usage: tools/bench_optimizer_vs_torch.sh [PARAMS] [THREADS] [REPEATS]   (defaults: 64M 2 3)
#
# Builds `lt` in release mode, then REPEATS rounds, each running once:
#   lt bench optimizer --optimizer adamw8bit --grad-dtype bf16 --write-copy bf16   (+ the upload copy)
#   and torch.optim.AdamW(fused=True) on CPU (tools/bench/torch_adamw.py), at the same time,
#   taking turns (--turns: TURN_STEPS timed steps each, default 5, alternating through two named
#   pipes, after a start-up lap so that neither times a step while the other starts up; each side
#   waits TURN_SETTLE_MS, default 50, after taking the token: torch's OpenMP workers spin for a
#   while after its turn and slowed lt's first step of each turn by 2-5 ms without it);
# then the same pair with lt's f8 codes (--optimizer adamw8bit-f8, a second torch fused run taking
# turns with it: the row "torch-fused/f8"); then, back to back:
#   lt bench optimizer --optimizer adamw8bit --grad-dtype bf16 | f32, and adamw8bit-f8 bf16
#   the same torch with PyTorch's huge-page allocation (--thp), as lt's host buffers use huge pages
#   lt bench optimizer --optimizer adamw     --grad-dtype bf16 | f32
#   bitsandbytes.optim.AdamW8bit on CPU (fewer steps: it runs at ~0.05 Gparam/s)
# and, before the pairs and after them, the memory bus's reference (tools/bench/torch_adamw.py
# --impl mem-scale: an in-place scale of an fp32 buffer, the plain read-modify-write stream that
# bounds a memory-bound update; the larger of the two is the round's bus);
# and prints a table of medians over the rounds with each one's ratio to torch fused and its GB/s
# as a fraction of the bus, then each
# round's ratio of the lt 8-bit rows to torch fused in that round (the acceptance figure is the
# 8-bit update with the bf16 copy, in every round: it takes turns with torch fused every ~0.25 s,
# so that the two see the same background load; run one after the other, a burst of load on this
# shared machine often fell on one of them only).
# The JSON line of every run (with each timed step) is kept in bench_optimizer_vs_torch.jsonl in
# the target directory (CARGO_TARGET_DIR, default target/).
# Each run's figure is the median of STEPS timed steps (default 30, about 1.5 s at 64M, so that
# a burst of load shorter than half a run does not move it). Interleaving the rounds exposes every
# configuration to the same background load; on a shared machine, quote the ratios rather than the
# absolute figures.
# Needs: cargo, python3 with torch and bitsandbytes (CPU), ~3 GiB of free memory at 64M params.
set -euo pipefail
cd "$(dirname "$0")/.."

PARAMS=${1:-64M}
THREADS=${2:-2}
REPEATS=${3:-3}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-3}
TURN_STEPS=${TURN_STEPS:-5}
TURN_SETTLE_MS=${TURN_SETTLE_MS:-50}

cargo build --release -p lt-cli >&2
LT=${CARGO_TARGET_DIR:-target}/release/lt
OUT=$(mktemp)
HUMAN=$(mktemp)
RING=$(mktemp -d)
trap 'rm -f "$OUT" "$HUMAN"; rm -rf "$RING"' EXIT

# lt_run OPTIMIZER GRAD_DTYPE COPY [lt options]; torch_run IMPL [torch_adamw.py options]
lt_run() {
    local opt=$1 dt=$2 cp=$3
    shift 3
    "$LT" bench optimizer --optimizer "$opt" --grad-dtype "$dt" --write-copy "$cp" --params "$PARAMS" \
        --threads "$THREADS" --steps "$STEPS" --warmup "$WARMUP" --json "$@" 2> >(tee -a "$HUMAN" >&2) \
        | tail -n 1 >> "$OUT"
}
torch_run() {
    python3 tools/bench/torch_adamw.py --impl "$@" --params "$PARAMS" --threads "$THREADS" \
        --steps "$STEPS" --warmup "$WARMUP" 2>/dev/null | tail -n 1 | tee -a "$OUT" | sed 's/^/torch: /' >&2
}
# The acceptance pair, taking turns; lt holds the token first. A fresh ring each time: the side
# that finishes last passes the token to nobody, and a leftover token would let the next pair run
# at the same time. The pipes are held open here (read-write: no blocking open, no end-of-file).
# If either side fails, the other would wait for the token for ever: stop it and fail.
paired_run() {
    local ring="$RING/$1-$2"
    mkfifo "$ring-lt" "$ring-torch"
    exec 3<>"$ring-lt" 4<>"$ring-torch"
    echo "{\"pair\": \"$2\"}" >> "$OUT"
    lt_run "$2" bf16 bf16 --turns "$ring-lt,$ring-torch" --turn-steps "$TURN_STEPS" \
        --turn-settle-ms "$TURN_SETTLE_MS" &
    local lt_pid=$!
    torch_run torch-fused --turns "$ring-torch,$ring-lt" --turn-steps "$TURN_STEPS" \
        --turn-settle-ms "$TURN_SETTLE_MS" &
    local torch_pid=$!
    printf t >&3
    local left=("$lt_pid" "$torch_pid") done_pid rc
    while [ "${#left[@]}" -gt 0 ]; do
        rc=0
        wait -n -p done_pid "${left[@]}" || rc=$?
        if [ "$rc" -ne 0 ]; then
            kill "$lt_pid" "$torch_pid" 2>/dev/null || true
            echo "the paired run failed (exit $rc from $([ "$done_pid" = "$lt_pid" ] && echo lt || echo torch))" >&2
            exit "$rc"
        fi
        left=("${left[@]/$done_pid/}")
        left=(${left[@]})
    done
    exec 3>&- 4>&-
}
for r in $(seq 1 "$REPEATS"); do
    echo "round $r/$REPEATS" >&2
    echo "{\"round\": $r}" >> "$OUT"
    torch_run mem-scale
    paired_run "$r" adamw8bit
    paired_run "$r" adamw8bit-f8
    echo '{"pair": null}' >> "$OUT"
    torch_run mem-scale
    lt_run adamw8bit bf16 none
    lt_run adamw8bit f32 none
    lt_run adamw8bit-f8 bf16 none
    torch_run torch-fused --thp
    lt_run adamw bf16 none
    lt_run adamw f32 none
    python3 tools/bench/torch_adamw.py --impl bnb-8bit --params "$PARAMS" --threads "$THREADS" \
        --steps 2 --warmup 1 2>/dev/null | tail -n 1 >> "$OUT"
done

# Every run's JSON line (each with its timed steps in run order, `seconds_per_step`), kept for a
# closer look at a round: which steps of a turn were slow, on which side.
RAW=${CARGO_TARGET_DIR:-target}/bench_optimizer_vs_torch.jsonl
cp "$OUT" "$RAW"
echo "raw runs: $RAW" >&2
# Host speeds hold for this CPU only: lt's own label, from the end of its last summary line.
sed -n 's/.*; host /host: /p' "$HUMAN" | tail -n 1
python3 - "$OUT" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
rows = [r for r in lines if "round" not in r and "pair" not in r]
groups = {}
rounds = []
pair = None
for r in lines:
    if "round" in r:
        rounds.append({})
        continue
    if "pair" in r:
        pair = r["pair"]
        continue
    key = (r["optimizer"], r["grad_dtype"], r.get("write_copy", "none"))
    # torch fused taking turns with the f8 update is its own row; with adamw8bit, the baseline.
    if r["optimizer"] == "torch-fused" and pair == "adamw8bit-f8":
        key = ("torch-fused/f8", *key[1:])
    groups.setdefault(key, []).append(r)
    if rounds:
        if key[0] == "mem-scale":
            # The round's bus: the faster of its two reference runs.
            rounds[-1][key] = max(rounds[-1].get(key, 0.0), r["gparams_per_s"])
        else:
            rounds[-1][key] = r["gparams_per_s"]
med = {k: statistics.median(x["gparams_per_s"] for x in v) for k, v in groups.items()}
base_key = ("torch-fused", "f32", "none")
base = med.get(base_key)
kernel = next((x.get("kernel") for x in rows if x.get("kernel") and x["optimizer"] == "adamw8bit"), "n/a")
stores = next((x.get("copy_stores") for x in rows if x.get("copy_stores") and x["optimizer"] == "adamw8bit"), "n/a")
print(f"lt 8-bit kernel: {kernel}, the copy's stores: {stores}")
bus_key = ("mem-scale", "none", "none")
bus = med[bus_key] * groups[bus_key][0]["bytes_per_param"] if bus_key in med else None
print(f"{'optimizer':<15} {'grads':<5} {'copy':<5} {'runs':>4} {'Gparam/s':>9} {'min..max':>13} {'x torch fused':>13} "
      f"{'B/param moved':>13} {'GB/s':>6} {'x bus':>5} {'state B/param':>13}")
for key, v in sorted(groups.items(), key=lambda kv: -med[kv[0]]):
    name, dt, cp = key
    g = [x["gparams_per_s"] for x in v]
    ratio = f"{med[key] / base:.2f}x" if base and name != "mem-scale" else "n/a"
    gbs = med[key] * v[0]["bytes_per_param"]
    of_bus = f"{gbs / bus:.2f}" if bus else "n/a"
    print(f"{name:<15} {dt:<5} {cp:<5} {len(v):>4} {med[key]:>9.3f} {min(g):>6.3f}..{max(g):<6.3f} {ratio:>13} "
          f"{v[0]['bytes_per_param']:>13.2f} {gbs:>6.1f} {of_bus:>5} "
          f"{statistics.median(x['state_bytes_per_param'] for x in v):>13.3f}")
print("mem-scale: the bus's reference (an in-place scale, 16 B per 'param'); x bus: a row's GB/s over the median of it")
print("per round, x torch fused of the same round (each 8-bit update with the copy took turns with a torch fused run;")
print("adamw8bit: bitsandbytes' dynamic maps, the acceptance figure; adamw8bit-f8: the f8 codes):")
for i, r in enumerate(rounds, 1):
    t = r.get(base_key)
    if not t:
        continue
    cells = [f"{n} {dt}{' + copy' if cp == 'bf16' else ''} {r[(n, dt, cp)] / t:.2f}x"
             for (n, dt, cp) in sorted(r) if n == "adamw8bit"]
    t8 = r.get(("torch-fused/f8", "f32", "none"))
    f8 = r.get(("adamw8bit-f8", "bf16", "bf16"))
    if t8 and f8:
        cells.append(f"adamw8bit-f8 bf16 + copy {f8 / t8:.2f}x (its own pair)")
    thp = r.get(("torch-fused-thp", "f32", "none"))
    acc = r.get(("adamw8bit", "bf16", "bf16"))
    if thp and acc:
        cells.append(f"(adamw8bit bf16 + copy against torch fused with huge pages {acc / thp:.2f}x)")
    b = r.get(bus_key)
    if b:
        gb = lambda k: r[k] * groups[k][0]["bytes_per_param"]
        bgbs = gb(bus_key)
        parts = [f"{label} {gb(k) / bgbs:.2f}" for label, k in [
            ("torch fused", base_key), ("adamw8bit + copy", ("adamw8bit", "bf16", "bf16")),
            ("torch fused/f8", ("torch-fused/f8", "f32", "none")), ("f8 + copy", ("adamw8bit-f8", "bf16", "bf16"))]
            if k in r]
        cells.append(f"bus {bgbs:.0f} GB/s, of it: " + ", ".join(parts))
    print(f"  round {i}: " + ", ".join(cells))
PY
