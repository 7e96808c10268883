#!/usr/bin/env bash
# Compare `lt bench spill` with dd (4 MiB blocks, O_DIRECT) on the same directory, in the same run.
#
# Usage: tools/bench_spill_vs_dd.sh [DIR] [SIZE_MIB] [REPEATS] [ENGINES]
#   DIR       directory on the disk under test (default: ./spill-bench, created and removed)
#   SIZE_MIB  MiB written and read per run (default 1024)
#   REPEATS   runs per tool, interleaved; the median is reported (default 3)
#   ENGINES   engines to run (default "io_uring pread"; "mmap" measures the page cache, not the disk)
#
# Needs the release binary: cargo build --release -p lt-cli   (or set LT=/path/to/lt).
# dd baseline:  dd if=/dev/zero of=DIR/dd.bin bs=4M count=N/4 oflag=direct   (write)
#               dd if=DIR/dd.bin of=/dev/null bs=4M iflag=direct               (read)
# Floor: lt >= 0.8x dd both ways; goal >= 1.0x. Both sides bypass the page cache.
set -euo pipefail

DIR=${1:-./spill-bench}
SIZE_MIB=${2:-1024}
REPEATS=${3:-3}
ENGINES=${4:-"io_uring pread"}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
LT=${LT:-$ROOT/target/release/lt}

[[ -x $LT ]] || { echo "error: $LT not found; run: cargo build --release -p lt-cli" >&2; exit 1; }
(( SIZE_MIB % 4 == 0 && SIZE_MIB > 0 )) || { echo "error: SIZE_MIB must be a positive multiple of 4" >&2; exit 1; }

CREATED=0
if [[ ! -d $DIR ]]; then mkdir -p "$DIR"; CREATED=1; fi
DD_FILE=$DIR/lt-bench-dd.$$.bin
cleanup() { rm -f "$DD_FILE"; if (( CREATED )); then rmdir "$DIR" 2>/dev/null || true; fi; }
trap cleanup EXIT

echo "disk: $(df -h "$DIR" | awk 'NR==2 {print $1" ("$2", "$4" free)"}'), dir $DIR, ${SIZE_MIB} MiB x ${REPEATS} runs" >&2

# dd prints "<bytes> bytes (...) copied, <seconds> s, <rate>"; compute MiB/s from bytes and seconds.
dd_mib_s() { awk '/copied/ { printf "%.1f\n", $1 / 1048576 / $(NF-3) }'; }
json_field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "nan" } else if (NR % 2) { print v[(NR + 1) / 2] } else { printf "%.1f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 } }'; }

declare -A RES
for ((r = 1; r <= REPEATS; r++)); do
    rm -f "$DD_FILE"
    w=$(dd if=/dev/zero of="$DD_FILE" bs=4M count=$((SIZE_MIB / 4)) oflag=direct 2>&1 | dd_mib_s)
    rd=$(dd if="$DD_FILE" of=/dev/null bs=4M iflag=direct 2>&1 | dd_mib_s)
    rm -f "$DD_FILE"
    RES[dd_w]+="$w "; RES[dd_r]+="$rd "
    echo "run $r: dd write $w read $rd MiB/s" >&2
    for e in $ENGINES; do
        line=$("$LT" bench spill --dir "$DIR" --size-mib "$SIZE_MIB" --engine "$e" --json | tail -n 1)
        w=$(json_field write_mib_s <<<"$line"); rd=$(json_field read_mib_s <<<"$line")
        RES[${e}_w]+="$w "; RES[${e}_r]+="$rd "
        echo "run $r: lt $e write $w read $rd MiB/s  $line" >&2
    done
done

med() { tr ' ' '\n' <<<"${RES[$1]}" | grep -v '^$' | median; }
ddw=$(med dd_w); ddr=$(med dd_r)
printf '\n%-10s %12s %12s %10s %10s\n' engine write_MiB/s read_MiB/s write/dd read/dd
printf '%-10s %12s %12s %10s %10s\n' dd "$ddw" "$ddr" 1.00 1.00
for e in $ENGINES; do
    w=$(med "${e}_w"); rd=$(med "${e}_r")
    printf '%-10s %12s %12s %10s %10s\n' "$e" "$w" "$rd" \
        "$(awk -v a="$w" -v b="$ddw" 'BEGIN { printf "%.2f", a / b }')" \
        "$(awk -v a="$rd" -v b="$ddr" 'BEGIN { printf "%.2f", a / b }')"
done
echo "(medians of $REPEATS interleaved runs, ${SIZE_MIB} MiB each, same directory)"
