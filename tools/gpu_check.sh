#!/usr/bin/env bash
# The one check to run on a lent H200 machine (16 cores, 128 GiB RAM, no cargo, no network), with a
# carried `lt` binary built with `cargo build --release -p lt-cli --features cuda`.
#
#   tools/gpu_check.sh [LT]            # LT: $1, else $LT_BIN, else ./target/release/lt
#   OUT=/tmp/x BATCH=8 tools/gpu_check.sh target-cuda/release/lt
#   OUT=$OUT PACK_LOGS=1 tools/gpu_check.sh carried/lt.gz   # a gzipped binary; logs in one .tgz
#
# Steps, each under its own `timeout` and capped by the overall budget so one hang cannot eat it,
# most valuable first: the first run on a fresh GPU compiles every kernel with NVRTC on one host
# thread and autotunes the matmuls (minutes: on the first H200 run, 2026-12-04, the bf16 selftest of
# one tiny fixture and a 7B step each ran past 140 s at 100% of one core), and `lt` keeps the
# compiled kernels on disk (LT_KERNEL_CACHE, default ~/.cache/lazytrain/kernels) so later steps and
# runs load them instead.
#   1. lt profile --device cuda --skip layer,disk --json: transfers (uploads from the optimizer's
#      page-locked bf16 copy, and from pageable and staged data), the GEMM peak, the host optimizer;
#      writes $OUT/cuda-measured.toml
#   2. lt selftest --device cuda $SELFTEST_ARGS --json: CUDA vs CPU parity on tiny fixtures
#      (tools/fixtures/), bf16 on a dense and a hybrid fixture by default; then the same with the
#      GEMMs on cuBLAS (LT_GEMM=cublas, not yet run on a GPU) and, if that passes, the GEMM peak
#      through cuBLAS (into $OUT/cuda-cublas-gemm.toml); the benchmarks then run with cuBLAS
#      (settings.gemm; LT_GEMM=cubecl in the environment keeps cubecl's kernels throughout)
#   3. lt bench train, Qwen2.5-7B (random init), seq 1024, batch $BATCH, steps $STEPS + $WARMUP
#      warm-up, policy auto and then megatrain, on the measured profile if step 1 wrote one (else the
#      built-in h200); each run reports the device memory reserved and the process's RSS per step
#   4. lt bench train, one Qwen3.6-27B-sized hybrid pair (a linear-attention and a full-attention
#      layer of the 27B's dimensions, configs/models/qwen3.6-27b-pair.json, whose vocabulary is cut to
#      1024 so the two layers dominate) at batch 1 x seq 1024: one timed step
#   5. lt profile's layer fit (a 7B-sized layer at 2048 tokens), into $OUT/cuda-measured-layer.toml
#   6. $OUT/gpu_check.json: nvidia-smi, where CUDA's toolkit and NVRTC were found, host facts, and
#      per step the command, exit code, seconds, whether it timed out or was killed, the last stdout
#      line (each lt command ends with one JSON line) and the tail of stderr (each command prints
#      progress lines there: per check, per step, per layer round). It is rewritten after every
#      step, so a killed run still leaves what finished.
# A failed step is recorded and the next one runs. Needs bash and coreutils only (no jq, no python).
# Exit status 124, or 137 at the limit, is a timeout; 137 before the limit is a SIGKILL from outside,
# most likely the kernel's out-of-memory killer ("killed" in the JSON). If the selftest really fails
# (not a timeout, not a kill), it is run again with LT_PIN_COPY=0, then also with LT_UPLOAD_COPY=0
# and LT_BF16_GRADS=0, and the first that passes is kept for the later steps (settings.pin_copy,
# settings.upload_copy, settings.bf16_grads).
# Knobs (environment): OUT, DEVICE (cuda; `wgpu` rehearses the script on any machine with a Vulkan
# driver, lavapipe included, with a small MODEL), BATCH (8), SEQ (1024), STEPS (6), WARMUP (1),
# MODEL, PAIR_MODEL, PAIR_SEQ (1024), FIXTURES, SELFTEST_ARGS, PROFILE_SKIP (layer,disk), HW (the
# built-in profile when `lt profile` fails: h200 on cuda, cpu on wgpu), and the limits in seconds
# BUDGET_S (560 in all: a device call may run 600), PROFILE_S (60), SELFTEST_S (180), SELFTEST2_S
# (90, the cuBLAS selftest), GEMM_S (45), BENCH_S (240, the first policy), BENCH2_S (120, the
# second), PAIR_S (60), LAYER_S (120).
# Exit code: 0 when every step passed, 1 otherwise.

set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LT=${1:-${LT_BIN:-./target/release/lt}}
# A gzipped binary (the cuda build is 61 MB, 15 MB gzipped) is unpacked into a temporary folder.
if [[ $LT == *.gz && -f $LT ]]; then
    UNPACKED=$(mktemp -d)/lt
    gzip -dc "$LT" >"$UNPACKED" && chmod +x "$UNPACKED" && LT=$UNPACKED
fi
OUT=${OUT:-./gpu-check-out}
DEVICE=${DEVICE:-cuda}
BATCH=${BATCH:-8}
SEQ=${SEQ:-1024}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-1}
MODEL=${MODEL:-$ROOT/configs/models/qwen2.5-7b.json}
PAIR_MODEL=${PAIR_MODEL:-$ROOT/configs/models/qwen3.6-27b-pair.json}
PAIR_SEQ=${PAIR_SEQ:-1024}
FIXTURES=${FIXTURES:-$ROOT/tools/fixtures}
if [[ $DEVICE == cuda ]]; then HW=${HW:-h200}; else HW=${HW:-cpu}; fi
# Seconds: the whole script, and each step at most (a step gets less when the budget runs short).
BUDGET_S=${BUDGET_S:-560}
SELFTEST_S=${SELFTEST_S:-180}
SELFTEST2_S=${SELFTEST2_S:-90}
GEMM_S=${GEMM_S:-45}
PROFILE_S=${PROFILE_S:-60}
BENCH_S=${BENCH_S:-240}
BENCH2_S=${BENCH2_S:-120}
PAIR_S=${PAIR_S:-60}
LAYER_S=${LAYER_S:-120}
# The first profile measures transfers, the GEMM peak and the host optimizer; the layer fit runs last.
PROFILE_SKIP=${PROFILE_SKIP:-layer,disk}
SELFTEST_ARGS=${SELFTEST_ARGS:---no-f32 --only qwen3-tied-mqa --only qwen35-hybrid}

mkdir -p "$OUT/logs" || { echo "gpu_check: cannot create $OUT" >&2; exit 1; }
JSON="$OUT/gpu_check.json"
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
T0=$SECONDS
STEP_JSON=()
FAILED=0

# A JSON string literal of "$1": backslash, quote and control characters escaped.
json_str() {
    local s
    s=$(printf '%s' "$1" | tr -d '\000-\010\013\014\016-\037')
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\t'/\\t}
    s=${s//$'\r'/\\r}
    s=${s//$'\n'/\\n}
    printf '"%s"' "$s"
}

# The last non-empty line of file "$1" if it looks like one JSON object, else null.
json_line() {
    local line
    line=$(grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1)
    if [[ $line == \{*\} ]]; then printf '%s' "$line"; else printf 'null'; fi
}

# A number field of a one-line JSON object (compact serde_json output), or empty.
json_num() {
    printf '%s' "$1" | sed -n "s/.*\"$2\":[[:space:]]*\\([-0-9.eE+]*\\).*/\\1/p" | head -n 1
}

write_json() {
    local steps="" i
    for i in "${!STEP_JSON[@]}"; do
        [[ $i -gt 0 ]] && steps+=","
        steps+=$'\n    '"${STEP_JSON[$i]}"
    done
    {
        printf '{\n'
        printf '  "script": "tools/gpu_check.sh",\n'
        printf '  "started": %s,\n' "$(json_str "$STARTED")"
        printf '  "finished": %s,\n' "$(json_str "$(date -u +%Y-%m-%dT%H:%M:%SZ)")"
        printf '  "elapsed_seconds": %d,\n' "$((SECONDS - T0))"
        printf '  "lt": %s,\n' "$(json_str "$LT")"
        printf '  "lt_version": %s,\n' "$(json_str "$LT_VERSION")"
        printf '  "settings": {"device": %s, "batch_size": %d, "seq_len": %d, "steps": %d, "warmup": %d, "model_config": %s, "pair_model_config": %s, "budget_seconds": %d, "upload_copy": %s, "pin_copy": %s, "bf16_grads": %s, "pinned_uploads": %s, "gemm": %s},\n' \
            "$(json_str "$DEVICE")" "$BATCH" "$SEQ" "$STEPS" "$WARMUP" "$(json_str "$MODEL")" "$(json_str "$PAIR_MODEL")" "$BUDGET_S" "$(json_str "${UPLOAD_COPY:-on}")" "$(json_str "${PIN_COPY:-on}")" "$(json_str "${BF16_GRADS:-on}")" "$(json_str "${LT_PINNED_UPLOADS:-off}")" "$(json_str "${GEMM_LIB:-cubecl}")"
        printf '  "host": {"nproc": %s, "mem_total_kib": %s, "kernel": %s},\n' \
            "$(nproc 2>/dev/null || echo null)" "${MEM_KIB:-null}" "$(json_str "$(uname -r)")"
        printf '  "cuda_runtime": %s,\n' "$(json_str "$CUDA_NOTE")"
        printf '  "nvidia_smi_rc": %d,\n' "$SMI_RC"
        printf '  "nvidia_smi_query": %s,\n' "$(json_str "$SMI_QUERY")"
        printf '  "nvidia_smi": %s,\n' "$(json_str "$SMI_FULL")"
        printf '  "hardware_used": %s,\n' "$(json_str "${HARDWARE:-}")"
        printf '  "summary": %s,\n' "${SUMMARY_JSON:-null}"
        printf '  "steps": [%s\n  ]\n' "$steps"
        printf '}\n'
    } >"$JSON.tmp" && mv "$JSON.tmp" "$JSON"
}

# run_step NAME LIMIT_S CMD...: run under timeout, log stdout/stderr, record the step. Sets RC, LAST
# (the step's last JSON line or null), TIMED_OUT and KILLED (true/false).
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - (SECONDS - T0)))
    [[ $limit -gt $left ]] && limit=$left
    local out="$OUT/logs/$name.stdout" err="$OUT/logs/$name.stderr" t=$SECONDS
    TIMED_OUT=false
    KILLED=false
    if [[ $limit -lt 5 ]]; then
        echo "gpu_check: $name: skipped, the ${BUDGET_S} s budget is spent" >&2
        RC=-1
        LAST=null
        : >"$out"
        echo "not run: the ${BUDGET_S} s budget is spent" >"$err"
    else
        echo "gpu_check: $name (limit ${limit} s): $*" >&2
        timeout -k 10 "$limit" "$@" >"$out" 2>"$err"
        RC=$?
        LAST=$(json_line "$out")
    fi
    local secs=$((SECONDS - t)) cmd note=""
    # timeout(1) exits 124 at the limit, or 137 when its follow-up KILL (-k) was needed; a 137 well
    # before the limit is a SIGKILL from elsewhere: on these machines, the out-of-memory killer.
    if [[ $RC -eq 124 ]] || [[ $RC -eq 137 && $secs -ge $limit ]]; then
        TIMED_OUT=true
        note=" (timed out)"
    elif [[ $RC -eq 137 ]]; then
        KILLED=true
        note=" (killed by SIGKILL before the limit: likely out of memory)"
    fi
    cmd=$(printf '%q ' "$@")
    STEP_JSON+=("{\"name\": $(json_str "$name"), \"command\": $(json_str "${cmd% }"), \"exit_code\": $RC, \"seconds\": $secs, \"timed_out\": $TIMED_OUT, \"killed\": $KILLED, \"limit_seconds\": $limit, \"result\": $LAST, \"stderr_tail\": $(json_str "$(tail -n 25 "$err" 2>/dev/null)")}")
    [[ $RC -ne 0 ]] && FAILED=$((FAILED + 1))
    echo "gpu_check: $name: exit $RC in ${secs} s$note" >&2
    write_json
}

# CUDA at run time: cubecl-cuda compiles its kernels with NVRTC (libnvrtc.so.N, found on the library
# path) against the toolkit's headers (CUDA_PATH/include, default /usr/local/cuda). Where the toolkit
# lives elsewhere, find it from nvcc, and put its library folders on the path when the loader does
# not already know libnvrtc.
CUDA_NOTE=""
if [[ $DEVICE == cuda ]]; then
    if [[ -z ${CUDA_PATH:-} && ! -d /usr/local/cuda ]] && command -v nvcc >/dev/null 2>&1; then
        CUDA_PATH=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
        export CUDA_PATH
    fi
    CUDA_ROOT=${CUDA_PATH:-/usr/local/cuda}
    if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
        for d in "$CUDA_ROOT/lib64" "$CUDA_ROOT/targets/x86_64-linux/lib" "$CUDA_ROOT/lib"; do
            if compgen -G "$d/libnvrtc.so*" >/dev/null; then
                export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                break
            fi
        done
    fi
    CUDA_NOTE="CUDA_PATH=${CUDA_PATH:-unset} (headers from $CUDA_ROOT/include: $([[ -f $CUDA_ROOT/include/cuda_runtime.h ]] && echo present || echo MISSING)); LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}; nvrtc: $( (ldconfig -p 2>/dev/null | grep -o 'libnvrtc\.so[.0-9]*' | sort -u | tr '\n' ' '; L=${LD_LIBRARY_PATH:-}; for d in ${L//:/ }; do ls "$d" 2>/dev/null | grep '^libnvrtc\.so'; done) | tr '\n' ' ')"
    echo "gpu_check: $CUDA_NOTE" >&2
fi

# Facts first: they cost nothing and explain everything after.
if command -v nvidia-smi >/dev/null 2>&1; then
    SMI_QUERY=$(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
        --format=csv,noheader 2>&1)
    SMI_RC=$?
    SMI_FULL=$(timeout 20 nvidia-smi 2>&1)
else
    SMI_QUERY="nvidia-smi not found"
    SMI_RC=127
    SMI_FULL=""
fi
MEM_KIB=$(sed -n 's/^MemTotal:[[:space:]]*\([0-9]*\) kB/\1/p' /proc/meminfo 2>/dev/null)
LT_VERSION=""
HARDWARE=""
SUMMARY_JSON=null
if [[ -x $LT ]]; then
    LT_VERSION=$(timeout 20 "$LT" --version 2>&1 | head -n 1)
else
    LT_VERSION="missing: $LT is not an executable file"
    echo "gpu_check: $LT is not an executable file; every step will fail" >&2
fi
write_json

# 1. The machine's transfers and GEMM peak (seconds; the layer fit, which compiles and autotunes a
# 7B-sized layer at 2048 tokens, runs last if time is left). Uploads read the optimizer's bf16 copy,
# page-locked unless LT_PIN_COPY=0.
PROFILE="$OUT/$DEVICE-measured.toml"
run_step profile "$PROFILE_S" "$LT" profile --device "$DEVICE" --out "$PROFILE" --skip "$PROFILE_SKIP" --json
GEMM_CUBECL=$(json_num "$LAST" gemm_tflops)
if [[ $RC -eq 0 && -s $PROFILE ]]; then HARDWARE=$PROFILE; else HARDWARE=$HW; fi

# 2. Backend parity (SELFTEST_ARGS: bf16 on two fixtures, a dense and a hybrid one, by default).
# shellcheck disable=SC2086 # SELFTEST_ARGS is a list of flags
run_step selftest "$SELFTEST_S" "$LT" selftest --device "$DEVICE" --fixtures "$FIXTURES" $SELFTEST_ARGS --json
# Every check carries "passed" too, and the overall flag is false when any check is.
SELFTEST="no result"
if [[ $LAST == *'"passed":false'* ]]; then
    SELFTEST="FAILED (see $OUT/logs/selftest.stderr)"
elif [[ $LAST == *'"passed":true'* ]]; then
    SELFTEST="passed"
fi

# The page-locked upload copies (cuMemHostRegister) and the optimizer-written bf16 copy (shared
# with the patched cubecl-runtime, no host copy) have not passed on a GPU yet: if the selftest
# really failed (a check failed or it errored; not a timeout, not a kill, which they would not
# explain), try it with LT_PIN_COPY=0 (pageable copies), then also with LT_UPLOAD_COPY=0 (convert
# the masters at each upload, as before) and LT_BF16_GRADS=0 (fp32 gradient buffers, as before:
# bf16 gradients kept as downloaded have not run on a GPU either); the first that passes is kept
# for the remaining steps, so that such a problem cannot cost the benchmark figures (the JSON says
# which way they ran).
UPLOAD_COPY=${LT_UPLOAD_COPY:-on}
PIN_COPY=${LT_PIN_COPY:-on}
BF16_GRADS=${LT_BF16_GRADS:-on}
if [[ $TIMED_OUT == true ]]; then
    SELFTEST="timed out (see $OUT/logs/selftest.stderr)"
elif [[ $KILLED == true ]]; then
    SELFTEST="killed, likely out of memory (see $OUT/logs/selftest.stderr)"
fi
if [[ $RC -ne 0 && $TIMED_OUT == false && $KILLED == false && $PIN_COPY != 0 ]]; then
    # shellcheck disable=SC2086
    run_step selftest-no-pin "$SELFTEST_S" env LT_PIN_COPY=0 "$LT" selftest --device "$DEVICE" \
        --fixtures "$FIXTURES" $SELFTEST_ARGS --json
    if [[ $RC -eq 0 ]]; then
        export LT_PIN_COPY=0
        PIN_COPY=0
        SELFTEST="failed with page-locked upload copies, passed without (see $OUT/logs/selftest*.stderr)"
    fi
fi
if [[ $RC -ne 0 && $TIMED_OUT == false && $KILLED == false && $UPLOAD_COPY != 0 ]]; then
    # shellcheck disable=SC2086
    run_step selftest-no-copy "$SELFTEST_S" env LT_PIN_COPY=0 LT_UPLOAD_COPY=0 LT_BF16_GRADS=0 "$LT" selftest \
        --device "$DEVICE" --fixtures "$FIXTURES" $SELFTEST_ARGS --json
    if [[ $RC -eq 0 ]]; then
        export LT_PIN_COPY=0 LT_UPLOAD_COPY=0 LT_BF16_GRADS=0
        PIN_COPY=0
        UPLOAD_COPY=0
        BF16_GRADS=0
        SELFTEST="failed with the optimizer's upload copy and bf16 gradients, passed without both (see $OUT/logs/selftest*.stderr)"
    fi
fi

# 2b. The GEMMs on cuBLAS (LT_GEMM=cublas: burn-cubecl's matmul hook, lt_model::gemm), which has
# not run on a GPU yet: parity on the same fixtures first; only if it passes, the GEMM peak through
# cuBLAS, and the benchmarks below run with it (both policies alike, so their ratio stays fair).
GEMM_LIB=cubecl
CUBLAS="not run"
if [[ $DEVICE == cuda && ${LT_GEMM:-} != cubecl ]]; then
    # shellcheck disable=SC2086
    run_step selftest-cublas "$SELFTEST2_S" env LT_GEMM=cublas "$LT" selftest --device "$DEVICE" \
        --fixtures "$FIXTURES" $SELFTEST_ARGS --json
    if [[ $RC -eq 0 && $LAST == *'"passed":true'* && $LAST != *'"passed":false'* ]]; then
        CUBLAS=passed
        run_step gemm-cublas "$GEMM_S" env LT_GEMM=cublas "$LT" profile --device "$DEVICE" \
            --out "$OUT/$DEVICE-cublas-gemm.toml" --skip transfers,layer,disk,optimizer --json
        GEMM_CUBLAS=$(json_num "$LAST" gemm_tflops)
        export LT_GEMM=cublas
        GEMM_LIB=cublas
    else
        CUBLAS="failed or did not finish (see $OUT/logs/selftest-cublas.stderr)"
    fi
fi

# 3. One streamed training benchmark, both policies in this run; the first compiles and autotunes
# the 7B's kernels (the cache makes the second cheap).
for POLICY in auto megatrain; do
    if [[ $POLICY == auto ]]; then LIMIT=$BENCH_S; else LIMIT=$BENCH2_S; fi
    run_step "bench-$POLICY" "$LIMIT" "$LT" bench train --model-config "$MODEL" --batch-size "$BATCH" \
        --seq-len "$SEQ" --policy "$POLICY" --steps "$STEPS" --warmup "$WARMUP" --device "$DEVICE" \
        --hardware "$HARDWARE" --json
    declare "BENCH_${POLICY}=$LAST"
done

# 4. One hybrid pair of Qwen3.6-27B's size (linear attention + full attention), one timed step.
run_step "hybrid-pair" "$PAIR_S" "$LT" bench train --model-config "$PAIR_MODEL" --batch-size 1 \
    --seq-len "$PAIR_SEQ" --policy keep-all --steps 1 --warmup 1 --device "$DEVICE" --hardware "$HARDWARE" --json
PAIR=$LAST

# 5. The layer fit for the cost model, if time is left (written to its own profile).
run_step profile-layer "$LAYER_S" "$LT" profile --device "$DEVICE" --out "$OUT/$DEVICE-measured-layer.toml" \
    --skip transfers,disk,optimizer --json

# 4. Summary.
TF_AUTO=$(json_num "${BENCH_auto:-}" tflops_6pt)
TF_MT=$(json_num "${BENCH_megatrain:-}" tflops_6pt)
STEP_AUTO=$(json_num "${BENCH_auto:-}" step_seconds)
STEP_MT=$(json_num "${BENCH_megatrain:-}" step_seconds)
PRED_AUTO=$(json_num "${BENCH_auto:-}" predicted_step_seconds)
PRED_MT=$(json_num "${BENCH_megatrain:-}" predicted_step_seconds)
PAIR_STEP=$(json_num "${PAIR:-}" step_seconds)
RESERVED2_AUTO=$(json_num "${BENCH_auto:-}" device_reserved_bytes_step2)
RESERVED_LAST_AUTO=$(json_num "${BENCH_auto:-}" device_reserved_bytes_last)
RSS_AUTO=$(json_num "${BENCH_auto:-}" peak_host_rss_bytes)
RATIO=""
if [[ -n $TF_AUTO && -n $TF_MT ]]; then
    RATIO=$(awk -v a="$TF_AUTO" -v b="$TF_MT" 'BEGIN { if (b > 0) printf "%.3f", a / b }')
fi
num_or_null() { if [[ -n $1 ]]; then printf '%s' "$1"; else printf 'null'; fi; }
SUMMARY_JSON="{\"selftest\": $(json_str "$SELFTEST"), \"tflops_6pt_auto\": $(num_or_null "$TF_AUTO"), \"tflops_6pt_megatrain\": $(num_or_null "$TF_MT"), \"auto_over_megatrain_tflops\": $(num_or_null "$RATIO"), \"step_seconds_auto\": $(num_or_null "$STEP_AUTO"), \"step_seconds_megatrain\": $(num_or_null "$STEP_MT"), \"predicted_step_seconds_auto\": $(num_or_null "$PRED_AUTO"), \"predicted_step_seconds_megatrain\": $(num_or_null "$PRED_MT"), \"device_reserved_bytes_step2_auto\": $(num_or_null "$RESERVED2_AUTO"), \"device_reserved_bytes_last_auto\": $(num_or_null "$RESERVED_LAST_AUTO"), \"peak_host_rss_bytes_auto\": $(num_or_null "$RSS_AUTO"), \"hybrid_pair_step_seconds\": $(num_or_null "$PAIR_STEP"), \"cublas_selftest\": $(json_str "$CUBLAS"), \"gemm_tflops_cubecl\": $(num_or_null "${GEMM_CUBECL:-}"), \"gemm_tflops_cublas\": $(num_or_null "${GEMM_CUBLAS:-}"), \"gemm\": $(json_str "$GEMM_LIB"), \"failed_steps\": $FAILED}"
write_json

echo
echo "gpu_check summary ($((SECONDS - T0)) s, results in $JSON)"
echo "  GPU:        ${SMI_QUERY:-none} (nvidia-smi exit $SMI_RC)"
echo "  lt:         $LT ($LT_VERSION)"
for i in "${!STEP_JSON[@]}"; do
    s=${STEP_JSON[$i]}
    name=$(printf '%s' "$s" | sed -n 's/^{"name": "\([^"]*\)".*/\1/p')
    rc=$(printf '%s' "$s" | sed -n 's/.*"exit_code": \(-\{0,1\}[0-9]*\),.*/\1/p')
    secs=$(printf '%s' "$s" | sed -n 's/.*"seconds": \([0-9]*\),.*/\1/p')
    printf '  %-16s exit %s in %s s\n' "$name" "$rc" "$secs"
done
echo "  selftest:   $SELFTEST"
echo "  cuBLAS:     selftest $CUBLAS; GEMM peak ${GEMM_CUBECL:-?} TFLOPS (cubecl) / ${GEMM_CUBLAS:-?} TFLOPS (cuBLAS); benchmarks on $GEMM_LIB"
echo "  hardware:   ${HARDWARE:-none}"
MODEL_NAME=$(basename "$MODEL" .json)
[[ $MODEL_NAME == config ]] && MODEL_NAME=$(basename "$(dirname "$MODEL")")
echo "  $MODEL_NAME batch $BATCH x seq $SEQ: auto ${TF_AUTO:-?} TFLOPS (${STEP_AUTO:-?} s/step, predicted ${PRED_AUTO:-?}), megatrain ${TF_MT:-?} TFLOPS (${STEP_MT:-?} s/step, predicted ${PRED_MT:-?})"
echo "  auto/megatrain TFLOPS ratio: ${RATIO:-n/a}"
echo "  device reserved (auto): after step 2 ${RESERVED2_AUTO:-?} B, after the last ${RESERVED_LAST_AUTO:-?} B; peak RSS ${RSS_AUTO:-?} B"
echo "  hybrid pair (27B-sized, batch 1 x seq $PAIR_SEQ): ${PAIR_STEP:-?} s/step"
# PACK_LOGS=1: the per-step logs as one $OUT/logs.tgz (for transports that bring back few files).
if [[ ${PACK_LOGS:-0} == 1 ]] && tar czf "$OUT/logs.tgz" -C "$OUT" logs; then rm -rf "$OUT/logs"; fi
[[ $FAILED -eq 0 ]]
