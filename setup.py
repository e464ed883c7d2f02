"""Compiles specx's CPU kernels (src/specx/runtime/kernels/forward.c) at install.

One library per instruction set, each optional: where the compiler or the CPU family cannot
build one, the install goes on and the runtime runs the ONNX Runtime and OpenVINO builds
(`specx.runtime.kernels` says which library loaded, or why none did). Everything else is in
pyproject.toml.
"""

import platform

from setuptools import Extension, setup

_SOURCE = "src/specx/runtime/kernels/forward.c"
_COMMON = ["-O3", "-fopenmp", "-fno-math-errno", "-mavx2", "-mfma", "-mf16c", "-std=c11"]
_ISAS = {
    "avx2": [],
    "vnni": ["-DSPX_VNNI", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
}


def _kernels() -> list[Extension]:
    if platform.machine().lower() not in ("x86_64", "amd64") or platform.system() != "Linux":
        return []
    return [
        Extension(
            f"specx.runtime.kernels._forward_{isa}",
            [_SOURCE],
            extra_compile_args=_COMMON + flags,
            extra_link_args=["-fopenmp"],
            optional=True,
        )
        for isa, flags in _ISAS.items()
    ]


setup(ext_modules=_kernels())
