"""Which PTX the plugin's kernel may be stamped with, and for which GPU: across Triton versions.

Triton stamps its PTX with the ISA version of its bundled ptxas (CUDA 13 for Triton 3.9),
and a CUDA 12 driver refuses to load PTX newer than it knows, so the plugin asks for the
highest version both accept. Triton's `get_ptxas` changed shape between the versions the
project allows (`triton>=3.3`): 3.3 `get_ptxas(arch)` returns a tuple (path, version),
3.4-3.5 `get_ptxas()` takes no argument and returns a tool object, 3.6+ `get_ptxas(arch)`
returns the tool object; `ptxas_version` reads each. Errors in that logic raise: a cap that
silently never applies is what this module replaces. Only a missing CUDA driver library
means "no cap" (Triton's default).

Imports triton only (no TensorRT, no torch at import).
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["device_arch", "driver_cuda_version", "driver_ptx_version", "ptxas_version"]


def ptxas_version(arch: int) -> str:
    """Triton's ptxas version for `arch`, e.g. "12.8" (any of Triton's `get_ptxas` forms)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        tool = get_ptxas(arch)
    except TypeError:  # Triton 3.4-3.5: get_ptxas() takes no argument
        tool = get_ptxas()
    if isinstance(tool, tuple):  # Triton <= 3.3: (path, version)
        return str(tool[1])
    return str(tool.version)


def driver_cuda_version() -> str | None:
    """The CUDA version the driver supports, e.g. "12.4"; None without a CUDA driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        raise RuntimeError("cuDriverGetVersion failed: is the CUDA driver installed correctly?")
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


@functools.cache
def driver_ptx_version(arch: int) -> int | None:
    """The highest PTX ISA version both the CUDA driver and Triton's ptxas accept.

    None (Triton's default) only where no CUDA driver is installed.
    """
    from triton.backends.nvidia.compiler import ptx_get_version

    driver = driver_cuda_version()
    if driver is None:
        return None
    return min(ptx_get_version(driver), ptx_get_version(ptxas_version(arch)))


def device_arch() -> int:
    """The compute capability of the current GPU as one number, e.g. 90.

    From torch: Triton's own driver query compiles a C helper on first use (needs gcc and
    the Python headers on the GPU machine).
    """
    import torch

    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor
