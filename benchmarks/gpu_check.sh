#!/usr/bin/env bash
# One command for a GPU host, after ../shared/gpu/README.md's install (PYTHONPATH set as it
# says): the CUDA tests, then benchmarks/gpu_bench.py in the time left, every result under
# OUT_DIR. The tests get at most half of SECONDS; the benchmark stops launching variants when
# its share runs out and reports the rest as not run.
#
#   bash benchmarks/gpu_check.sh SECONDS OUT_DIR [gpu_bench.py options...]
#   bash benchmarks/gpu_check.sh 540 "$OUT"      # fits the device's 10 minutes a call
#   bash benchmarks/gpu_check.sh 480 "$OUT" --batch-sizes 8192   # one batch size: fits a session
#
# GPU_CHECK_W3_SECONDS=N keeps the last N seconds for W3 on CUDA (benchmarks/w3_bench.py --device
# cuda --steps 2000 --warmup 300, then the options in GPU_CHECK_W3_ARGS, which override them;
# results in OUT_DIR/w3.json); 0 (the default) skips it.
set -u
usage="usage: bash benchmarks/gpu_check.sh SECONDS OUT_DIR [gpu_bench.py options...]"
limit=${1:?$usage}
out=${2:?$usage}
shift 2
case $limit in '' | *[!0-9]*) echo "SECONDS must be a whole number, got '$limit'; $usage" >&2; exit 2 ;; esac
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
start=$(date +%s)
left() { echo $((limit - ($(date +%s) - start))); }

nvidia-smi >"$out/nvidia-smi.txt" 2>&1
"$py" - >"$out/versions.txt" 2>&1 <<'PY'
import fbgemm_gpu, torch, torchrec
print("torch", torch.__version__, "fbgemm_gpu", fbgemm_gpu.__version__, "torchrec", torchrec.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU visible")
PY
cat "$out/versions.txt"

# Six workers share the GPU (71 s for the CUDA tests on an H200); -rfE names every failure.
timeout $((limit / 2)) "$py" -m pytest -m cuda -q -p no:cacheprovider -n "${GPU_CHECK_WORKERS:-6}" \
    -rfE --durations=12 --junitxml="$out/cuda_tests.xml" tests >"$out/cuda_tests.log" 2>&1
tests=$?
tail -n 5 "$out/cuda_tests.log"

w3_s=${GPU_CHECK_W3_SECONDS:-0}
case $w3_s in '' | *[!0-9]*) echo "GPU_CHECK_W3_SECONDS must be a whole number, got '$w3_s'" >&2; exit 2 ;; esac
bench_s=$(($(left) - 20 - w3_s))  # room for the benchmark's report after its last variant
timeout "$((bench_s + 15))" "$py" benchmarks/gpu_bench.py --out "$out/gpu.json" \
    --time-limit "$bench_s" --dir "${GPU_CHECK_TMP:-/tmp}" --profile-steps 3 "$@" \
    >"$out/gpu_bench.log" 2>&1
bench=$?
sed -n '/^W1 on /,$p' "$out/gpu_bench.log"

w3=0
if [ "$w3_s" -gt 0 ]; then
    read -ra w3_args <<<"${GPU_CHECK_W3_ARGS:-}"
    timeout "$(($(left) > 10 ? $(left) - 5 : 5))" "$py" benchmarks/w3_bench.py --device cuda \
        --steps 2000 --warmup 300 --dir "${GPU_CHECK_TMP:-/tmp}" --out "$out/w3.json" \
        "${w3_args[@]}" >"$out/w3.log" 2>&1
    w3=$?
    sed -n '/^variant /,$p' "$out/w3.log"
fi

echo "cuda tests: exit $tests; gpu_bench: exit $bench; w3: exit $w3 ($w3_s s kept);" \
    "$(($(date +%s) - start)) s of $limit" | tee "$out/summary.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$w3" -eq 0 ]
