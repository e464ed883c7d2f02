#!/usr/bin/env bash
# Every check that needs a GPU, in one run (< 10 minutes on one GPU), with a JSON summary.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, after
#   pip install -e ".[dev,gpu]" --extra-index-url https://pypi.nvidia.com
#
# 1. the Triton TreeAttention kernel compiled for this GPU vs the torch reference
#    (tests/test_triton_kernel.py; on CPU these run in Triton's interpreter);
# 2. the tensorrt.plugin AOT plugin inside a TensorRT network (tests/test_trt_plugin.py);
# 3. engines built by `specx build --backend trt` (fp32, fp16, an EAGLE-3 head), greedy
#    equal to ONNX Runtime, speculation lossless, pack + verify on this GPU
#    (tests/test_trt_engine.py).
# Prints one JSON object: environment, and passed/failed/skipped per file. Exit 0 only
# when nothing failed and nothing was skipped (a skip on a GPU machine is a finding).
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
files=(tests/test_triton_kernel.py tests/test_trt_plugin.py tests/test_trt_engine.py)
status=0
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    timeout 300 python -m pytest -q -rs "$f" --junitxml="$out/$name.xml" >"$out/$name.log" 2>&1
    code=$?
    echo "$code" >"$out/$name.code"  # 124: killed by timeout, and no junit report then
    [ "$code" -ne 0 ] && status=1
    tail -n 5 "$out/$name.log" >&2
done
python -m benchmarks.gpu_summary "$out" "${files[@]}"
summary_status=$?
rm -rf "$out"
exit $(( status | summary_status ))
