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
    [ "$code" -ne 0 ] && status=1
    tail -n 5 "$out/$name.log" >&2
done
python - "$out" "${files[@]}" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, files = Path(sys.argv[1]), sys.argv[2:]
summary = {"environment": {}, "files": {}}
try:
    import torch
    summary["environment"]["torch"] = torch.__version__
    if torch.cuda.is_available():
        summary["environment"]["gpu"] = torch.cuda.get_device_name()
        summary["environment"]["compute_capability"] = "{}.{}".format(
            *torch.cuda.get_device_capability())
except ImportError:
    pass
for module in ("tensorrt", "triton", "onnxruntime"):
    try:
        summary["environment"][module] = __import__(module).__version__
    except ImportError:
        summary["environment"][module] = None
clean = True
for f in files:
    name = Path(f).stem
    suite = ET.parse(out / f"{name}.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["seconds"] = float(suite.get("time", 0))
    counts["skip_reasons"] = sorted(
        {(s.text or s.get("message", "")).strip()[-200:] for s in suite.iter("skipped")})
    summary["files"][f] = counts
    clean &= counts["failures"] == counts["errors"] == counts["skipped"] == 0
summary["ok"] = clean
print(json.dumps(summary, indent=2))
sys.exit(0 if clean else 1)
PY
summary_status=$?
rm -rf "$out"
exit $(( status | summary_status ))
