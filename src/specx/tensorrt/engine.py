"""Building TensorRT engines from lowered specx graphs (Polygraphy loaders over TensorRT).

Imports `tensorrt`, `polygraphy.backend.trt` and the TreeAttention plugin only when
called, so the rest of specx works without them. The build is a Polygraphy loader chain:

    EngineBytesFromNetwork(NetworkFromOnnxPath(onnx, strongly_typed=True),
                           CreateConfig(profiles, timing cache, optimization level,
                                        aliased plugin I/O), save_timing_cache=...)

Strongly typed: the lowered graph's dtypes are the engine's precision (TensorRT 11 has
no precision flags). The plugin's outputs alias its cache inputs, which TensorRT allows
with the ALIASED_PLUGIN_IO_10_03 preview feature.
"""

from __future__ import annotations

import os
from pathlib import Path

from specx.artifact import atomic_write_bytes, sha256_file
from specx.errors import BuildError
from specx.tensorrt.profiles import Shapes

__all__ = ["MIN_TENSORRT", "build_engine", "device_summary", "import_tensorrt"]

MIN_TENSORRT = (10, 15)  # the first parser with TensorScatter (in-place KV update) and Attention
INSTALL_HINT = (
    "install TensorRT >= 10.15 with its Python bindings on a machine with an NVIDIA GPU: "
    "pip install 'specx[gpu]' (TensorRT wheels come from NVIDIA's index, "
    "--extra-index-url https://pypi.nvidia.com)"
)


def import_tensorrt():
    """The `tensorrt` module, or a BuildError saying exactly what is missing."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise BuildError(f"TensorRT is not installed ({e}); {INSTALL_HINT}") from e
    version = tuple(int(p) for p in trt.__version__.split(".")[:2])
    if version < MIN_TENSORRT:
        raise BuildError(f"TensorRT {trt.__version__} is too old; {INSTALL_HINT}")
    return trt


def device_summary() -> tuple[str, str, str]:
    """The TensorRT version, the GPU's compute capability ("major.minor") and its name.

    Raises:
        BuildError: TensorRT, torch with CUDA, or a GPU is missing.
    """
    trt = import_tensorrt()
    try:
        import torch
    except ImportError as e:
        raise BuildError(f"the TensorRT backend needs torch with CUDA ({e})") from e
    if not torch.cuda.is_available():
        raise BuildError("no CUDA device is visible: TensorRT engines are built on the GPU")
    major, minor = torch.cuda.get_device_capability()
    return trt.__version__, f"{major}.{minor}", torch.cuda.get_device_name()


def build_engine(
    onnx_path: Path,
    engine_path: Path,
    profiles: dict[str, dict[str, Shapes]],
    optimization_level: int = 3,
    timing_cache: Path | None = None,
) -> str:
    """Parses `onnx_path` with the plugin registered, builds and writes the engine atomically.

    The engine's optimization profiles are those of `profiles`, in its order.

    Returns:
        The engine's sha256.
    """
    trt = import_tensorrt()
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        NetworkFromOnnxPath,
        Profile,
    )

    from specx.tensorrt.plugin import register_tree_attention_plugin

    register_tree_attention_plugin()  # must precede parsing: the parser looks plugins up by name
    trt_profiles = []
    for shapes in profiles.values():
        profile = Profile()
        for name, (low, opt, high) in shapes.items():
            profile.add(name, low, opt, high)
        trt_profiles.append(profile)
    cache = None if timing_cache is None else str(timing_cache)
    config = CreateConfig(
        profiles=trt_profiles,
        builder_optimization_level=optimization_level,
        load_timing_cache=cache if cache and os.path.exists(cache) else None,
        preview_features=[trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03],
    )
    network = NetworkFromOnnxPath(str(onnx_path), strongly_typed=True)
    try:
        engine = EngineBytesFromNetwork(network, config, save_timing_cache=cache)()
    except Exception as e:  # Polygraphy raises PolygraphyException with TensorRT's log
        raise BuildError(f"TensorRT could not build {onnx_path.name}: {e}") from e
    atomic_write_bytes(engine_path, bytes(engine))
    return sha256_file(engine_path)
