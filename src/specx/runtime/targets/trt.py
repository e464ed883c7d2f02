"""`TrtTarget`: an artifact's TensorRT engines, with the same interface as `OrtTarget`.

Imported only when the manifest's default build is a TensorRT one; it needs `tensorrt`
and `torch` with CUDA (device buffers and the stream). Caches are device tensors bound to
both `past_*` and `present_*`: TensorRT's KV-cache update layer and the TreeAttention
plugin (aliased outputs) write them in place. Each engine has two optimization profiles
(see `specx.tensorrt.profiles`); a forward of at most `max_tree_tokens` tokens runs on the
decode profile, longer ones (prompts) on the prefill profile. Logits come back to the host
as float32 numpy arrays, so drafting and verification are the CPU runtime's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from specx.artifact import Manifest
from specx.errors import ArtifactError, GenerationError
from specx.runtime.kv_cache import KVCache
from specx.runtime.targets.base import DecoderBackend, StepOutput

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["TrtGraph", "TrtTarget"]


class _Engine:
    """A deserialized engine with one execution context per optimization profile."""

    def __init__(self, manifest: Manifest, graph: str):
        import tensorrt as trt
        import torch

        build = manifest.build
        assert build is not None, "a TensorRT engine comes from a build"
        capability = "{}.{}".format(*torch.cuda.get_device_capability())
        problems = build.engine_mismatches(trt.__version__, capability)
        if problems:
            raise ArtifactError(f"{manifest.root}: " + "; ".join(problems))
        entry = manifest.runtime_graph(graph)
        if entry.engine is None:
            build_name = manifest.default_build
            raise ArtifactError(f"{manifest.root}: build {build_name!r} has no {graph} engine")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(manifest.path(entry.engine).read_bytes())
        if self.engine is None:
            raise ArtifactError(f"{entry.engine}: TensorRT could not deserialize the engine")
        self.stream = torch.cuda.Stream()
        self.contexts = []
        for index in range(len(entry.profiles)):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append(context)
        self.torch = torch

    @property
    def io_names(self) -> list[str]:
        """Every input and output tensor of the engine."""
        return [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]

    def set_shapes(self, profile: int, tensors: dict[str, Tensor]) -> None:
        """Sets the shape of every input among `tensors` on the profile's context.

        Raises:
            GenerationError: a shape outside the profile's range (named), instead of a
                generic failure at execution.
        """
        import tensorrt as trt

        context = self.contexts[profile]
        for name, tensor in tensors.items():
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                if not context.set_input_shape(name, tuple(tensor.shape)):
                    raise GenerationError(
                        f"{name} {tuple(tensor.shape)} is outside the engine's optimization "
                        f"profile {profile} (rebuild with a larger --max-batch or context?)"
                    )

    def run(self, profile: int, tensors: dict[str, Tensor]) -> None:
        """Binds `tensors` and executes on the profile, after torch's queued work.

        `tensors` are torch CUDA tensors by IO name, one for every input and output of the
        engine (TensorRT needs every address set).
        """
        missing = sorted(set(self.io_names) - set(tensors))
        if missing:
            raise ArtifactError(f"no buffer bound for the engine's tensors {missing}")
        self.set_shapes(profile, tensors)
        context = self.contexts[profile]
        for name, tensor in tensors.items():
            if not context.set_tensor_address(name, tensor.data_ptr()):
                raise ArtifactError(f"TensorRT refused the address of {name}")
        # Inputs were copied and outputs allocated on torch's current stream.
        self.stream.wait_stream(self.torch.cuda.current_stream())
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise ArtifactError("TensorRT execute_async_v3 failed (see the TensorRT log)")
        self.stream.synchronize()


class TrtTarget(DecoderBackend):
    """A decoder graph (`"target"` or `"draft_head"`) on its TensorRT engine."""

    def __init__(self, manifest: Manifest, graph: str = "target"):
        super().__init__(manifest, graph)
        self._engine = _Engine(manifest, graph)
        self._torch = self._engine.torch
        self._cache_dtype = getattr(self._torch, self.cache_dtype.name)

    def allocate_cache(self, batch: int, capacity: int | None = None) -> KVCache:
        """Full-capacity device caches: the engine's cache dimension is static."""
        self.checked_capacity(capacity)
        shape = (batch, self.num_kv_heads, self.capacity, self.head_dim)

        def zeros():
            return self._torch.zeros(shape, dtype=self._cache_dtype, device="cuda")

        return KVCache(
            keys=[zeros() for _ in range(self.num_layers)],
            values=[zeros() for _ in range(self.num_layers)],
            lengths=np.zeros(batch, dtype=np.int64),
        )

    def forward(
        self,
        cache: KVCache,
        input_ids: np.ndarray,  # [B, N] int64
        position_ids: np.ndarray,  # [B, N] int64
        attention_mask: np.ndarray,  # [B, 1, N, L] bool
        write_pos: np.ndarray,  # [B] int64
        features: np.ndarray | None = None,  # [B, N, d] for draft heads
    ) -> StepOutput:
        """One forward of N tokens per sequence; see `OrtTarget.forward`."""
        self.check_step(cache, input_ids, attention_mask, write_pos)
        torch = self._torch
        batch, n = input_ids.shape

        def device(array: np.ndarray, dtype) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).cuda()

        # Device tensors, the cache's too (allocate_cache: KVCache's annotations say numpy).
        tensors: dict[str, Any] = {
            "input_ids": device(input_ids, np.int64),
            "position_ids": device(position_ids, np.int64),
            "attention_mask": device(attention_mask, bool),
            "write_pos": device(write_pos, np.int64),
        }
        if self._feature_input is not None:
            if features is None:  # as OrtTarget: np.ascontiguousarray(None) is a NaN, not an error
                raise GenerationError("this draft-head graph needs `features` [B, N, d]")
            tensors[self._feature_input] = device(features, np.float32)
        for i, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
            tensors |= {f"past_key_{i}": keys, f"present_key_{i}": keys}
            tensors |= {f"past_value_{i}": values, f"present_value_{i}": values}
        logits = torch.empty((batch, n, self.vocab_size), dtype=torch.float32, device="cuda")
        tensors["logits"] = logits
        taps = None
        if self.has_taps:
            taps = torch.empty((batch, n, self.tap_width), dtype=torch.float32, device="cuda")
            tensors[self._hidden_output] = taps
        self._engine.run(0 if n <= self.max_tree_tokens else 1, tensors)
        return StepOutput(
            logits=logits.cpu().numpy(), taps=None if taps is None else taps.cpu().numpy()
        )


class TrtGraph:
    """A one-input graph of the artifact (Medusa heads, EAGLE-3 projection) on TensorRT."""

    def __init__(self, manifest: Manifest, graph: str):
        self._engine = _Engine(manifest, graph)
        entry = manifest.runtime_graph(graph)
        self.input_name = entry.inputs[0].name
        self.output_name = entry.outputs[0].name
        self.max_tokens = manifest.model.max_tree_tokens

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The graph's first output for input `x` [B, N, d] (every output is bound)."""
        torch = self._engine.torch
        inputs = torch.from_numpy(np.ascontiguousarray(x, np.float32)).cuda()
        profile = 0 if x.shape[1] <= self.max_tokens else 1
        self._engine.set_shapes(profile, {self.input_name: inputs})
        context = self._engine.contexts[profile]
        tensors = {self.input_name: inputs}
        for name in self._engine.io_names:
            if name != self.input_name:
                shape = tuple(context.get_tensor_shape(name))
                tensors[name] = torch.empty(shape, dtype=torch.float32, device="cuda")
        self._engine.run(profile, tensors)
        return tensors[self.output_name].cpu().numpy()
