"""The JSON summary of benchmarks/gpu_check.sh: environment, and per test file its counts.

    python -m benchmarks.gpu_summary OUT_DIR tests/test_a.py tests/test_b.py ...

OUT_DIR holds each file's junit XML (`<name>.xml`) and pytest exit code (`<name>.code`). A
file without a report (pytest killed by `timeout`, or crashed) is reported with its exit
code instead of breaking the summary. Exit 0 only when every file ran with nothing failed,
errored or skipped.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def environment() -> dict:
    found: dict = {}
    try:
        import torch

        found["torch"] = torch.__version__
        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name()
            found["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
    except ImportError:
        pass
    for module in ("tensorrt", "triton", "onnxruntime"):
        try:
            found[module] = __import__(module).__version__
        except ImportError:
            found[module] = None
    return found


def file_summary(out: Path, name: str) -> dict:
    code_file = out / f"{name}.code"
    code = int(code_file.read_text().strip()) if code_file.is_file() else None
    report = out / f"{name}.xml"
    try:
        suite = ET.parse(report).getroot()
    except (OSError, ET.ParseError) as e:
        reason = "timed out (killed by timeout)" if code == 124 else f"no junit report ({e})"
        return {"exit_code": code, "error": reason}
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts: dict = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["seconds"] = float(suite.get("time", 0))
    counts["exit_code"] = code
    counts["skip_reasons"] = sorted(
        {(s.text or s.get("message", "")).strip()[-200:] for s in suite.iter("skipped")}
    )
    return counts


def main() -> int:
    out, files = Path(sys.argv[1]), sys.argv[2:]
    summary = {"environment": environment(), "files": {}}
    clean = True
    for f in files:
        counts = file_summary(out, Path(f).stem)
        summary["files"][f] = counts
        clean &= "error" not in counts and counts["failures"] == counts["errors"] == 0
        clean &= counts.get("skipped", 0) == 0
    summary["ok"] = clean
    print(json.dumps(summary, indent=2))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
