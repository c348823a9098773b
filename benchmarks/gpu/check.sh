#!/usr/bin/env bash
# The GPU check, in one command on a machine with a CUDA device: the `gpu` tests, results under
# ${OUT:-./gpu-results}. See README.md here.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-./gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
"$PY" -c "import torch; print(torch.cuda.get_device_name(0), 'torch', torch.__version__)" | tee "$OUT/device.txt"
status=0
# ONLY="memory_profile workloads" runs those parts alone (a rerun in the device time left);
# WORKLOAD_PARTS="latency,throughput" narrows workloads.py to those of its parts.
run() {   # run NAME CMD...: its output to $OUT/NAME.log, a line in the summary
    local name=$1; shift
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    local start=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1; local rc=$?
    [ $rc -ne 0 ] && status=1
    printf '%-24s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" "$(tail -n 1 "$OUT/$name.log")" >> "$OUT/summary.txt"
}
: > "$OUT/summary.txt"
# What `treadle serve` needs and the machine lacks, where wheels.sh put it in .whl (carried).
if compgen -G ".whl/*.whl" > /dev/null; then
    SITE=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# Each part has a limit of its own, so the whole check stays within 8 minutes (480 s of limits).
# Every `gpu` test but the sizing's, in 8 pytest-xdist workers where xdist is installed: Triton's
# first compiles (most of the time on a fresh machine) overlap, and each engine takes the fixed
# KV cache tests/gpu.py names. A module whose imports this machine lacks must not stop the
# rest; a test past 120 s fails with its traceback where pytest-timeout is installed. At the
# limit pytest gets SIGINT first, so that it still writes its report of what ran.
OPTS=()
"$PY" -c "import xdist" 2>/dev/null && OPTS+=(-n 8)
"$PY" -c "import pytest_timeout" 2>/dev/null && OPTS+=(--timeout 120)
# A module has gpu tests where it marks them, or takes conftest's `on_device` fixture (a cpu
# and a cuda case). tests/test_gpu_machine_imports.py selects them alike.
mapfile -t GPU_FILES < <(grep -lE "mark\.gpu|on_device" tests/test_*.py | grep -v test_memory_profile.py)
run gpu_tests timeout -s INT -k 5 175 "$PY" -m pytest -q -rfE -m gpu ${OPTS[@]+"${OPTS[@]}"} "${GPU_FILES[@]}" \
    --continue-on-collection-errors --junitxml="$OUT/gpu_tests.xml"
# KV sizing by gpu_memory_utilization (the decode graphs' pool counted), and the error when
# memory is held at start-up: alone on the device, as they measure it.
run memory_profile timeout 40 "$PY" -m pytest -q -rfE -m gpu tests/test_memory_profile.py \
    --junitxml="$OUT/memory_profile.xml"
# Issue 45's workloads (exactness, latency, profile, throughput, serving where the wheels are,
# transformers' throughput): $OUT/workloads.json. On the triton backend: its kernels, fused ops
# and decode CUDA graphs are the GPU engine.
run workloads timeout 205 "$PY" benchmarks/gpu/workloads.py --out "$OUT" \
    --engine '{"attention_backend": "triton"}' ${WORKLOAD_PARTS:+--parts "$WORKLOAD_PARTS"}
# Issue 45's choice for the norms, SiLU-and-mul and RoPE: eager, torch.compile or Triton, timed;
# then the few-row linears with those ops fused in (models/triton_gemv.py) against the path they
# would replace, at one token; $OUT/fused_ops.json. torch.compile stops starting at 8 s, and
# the file is written after every op, so a run cut short keeps what it timed.
run fused_ops timeout 30 "$PY" benchmarks/gpu/fused_ops.py --budget-s 8 --out "$OUT"
# When decodes should take the split-KV path: the unified kernel against 2-16 splits, batches of
# 1-32, contexts of 256-4096, in CUDA graphs; and at 256 decodes, the unified kernel's GB/s in
# five shapes against what a copy moves; $OUT/decode_attention.json. About 20 Triton compiles,
# the batch of 256 first.
run decode_attention timeout 30 "$PY" benchmarks/gpu/decode_attention.py --out "$OUT"
cat "$OUT/summary.txt"
exit $status
