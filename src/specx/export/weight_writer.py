"""The target's data file written by a second process while the first traces the graph.

Tracing is CPU-bound Python; writing the weights is CPU-bound too on a small machine
(widening, tiled transposes, sha256 and the kernel's page-cache copies). As two threads
they shared one GIL and each waited for the other. Measured on the 1.5B export with 2
cores: as threads of one process the two took longer than running one after the other, and
as two processes less (docs/decisions.md#weights-written-by-second-process).

`WeightWriter` is the parent's handle: a `specx.graphs.model_io.TensorSink` whose
`DataFile` lives in the child. The child starts on the weights the graph will most likely
hold (`planned_weights`) at once; once the graph is traced, each initializer is either
found among them (`reuse`) or appended (a checkpoint-backed weight is described and
computed by the child, anything else sent as bytes).

Protocol (pickle frames; the child's stdin and a duplicate of its stdout): the parent sends
`_Setup`, then `_Streamed` / `_Bytes` / `_CLOSE`; the child answers each plan and each
append with `(offset, length)` and the close with the sha256, or with a `_Failure`.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import onnx_ir as ir

from specx.errors import ExportError
from specx.export.streamed_weights import Scratch, StreamedTensor
from specx.graphs.model_io import SIZE_THRESHOLD, DataFile

if TYPE_CHECKING:
    from specx.export.checkpoint import CheckpointTensors

__all__ = ["PlannedWeight", "WeightWriter", "planned_weights"]


@dataclass(frozen=True)
class PlannedWeight:
    """A weight as the export will most likely write it: checkpoint keys, orientation."""

    keys: tuple[str, ...]
    transposed: bool


_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def planned_weights(tensors: CheckpointTensors, names: Sequence[str]) -> list[PlannedWeight]:
    """The target's weights in the form its graph will most likely hold them.

    Linear weights are transposed (MatMul takes [in, out]), q/k/v and gate/up side by side
    (`specx.graphs.packed_matmuls`), the rest as stored; tensors the graph keeps inline
    (`SIZE_THRESHOLD` bytes or fewer) are left out.
    A guess, checked when the graph is saved: a weight the graph needs in another form is
    simply written again.
    """
    plans, taken = [], set()
    for name in names:
        if name in taken or tensors.nbytes(name) <= SIZE_THRESHOLD:
            continue
        keys = [name]
        for group in _SIBLINGS:
            if name.endswith(f"{group[0]}.weight"):
                siblings = [name.replace(group[0], member) for member in group]
                if all(s in tensors for s in siblings):
                    keys = siblings
        linear = name == "lm_head.weight" or name.endswith("_proj.weight")
        taken.update(keys)
        plans.append(PlannedWeight(tuple(keys), linear and len(tensors.shape(name)) == 2))
    return plans


@dataclass(frozen=True)
class _Setup:
    directory: Path
    name: str
    tensors: CheckpointTensors
    plans: list[PlannedWeight]


@dataclass(frozen=True)
class _Streamed:
    """A StreamedTensor, described: the child reads and converts it."""

    keys: tuple[str, ...]
    transposed: bool
    shape: tuple[int, ...]
    name: str


@dataclass(frozen=True)
class _Bytes:
    data: bytes


@dataclass(frozen=True)
class _Failure:
    error: BaseException


_CLOSE = "close"


def _plan_shape(tensors: CheckpointTensors, plan: PlannedWeight) -> tuple[int, ...]:
    shapes = [tensors.shape(k) for k in plan.keys]
    if plan.transposed:
        return (shapes[0][1], sum(s[0] for s in shapes))
    return shapes[0]


class WeightWriter:
    """`directory/name` written by a child process, starting with `plans`.

    A context manager: leaving it without `close()` (an error, an interrupt) stops the
    child and removes the partial file.

    Raises (from any method):
        ExportError: the child died; or what it raised while reading the checkpoint.
    """

    def __init__(
        self,
        directory: Path,
        name: str,
        tensors: CheckpointTensors,
        plans: list[PlannedWeight],
    ):
        self.temporary = Path(directory) / f".{name}.tmp"  # DataFile's name for it
        self.plans = plans
        self._written: dict[PlannedWeight, tuple[int, int]] | None = None  # offset, length
        self._base_dir, self._name = Path(directory), name
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p
        )}  # fmt: skip
        self._process = subprocess.Popen(
            [sys.executable, "-m", "specx.export.weight_writer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._process.stdin is not None and self._process.stdout is not None  # PIPEs
        self._stdin, self._stdout = self._process.stdin, self._process.stdout
        self._send(_Setup(Path(directory), name, tensors, plans))

    def _send(self, message: Any) -> None:
        try:
            pickle.dump(message, self._stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._stdin.flush()
        except BrokenPipeError:
            self._receive()  # the child's own error, if it sent one
            raise self._died() from None

    def _receive(self) -> Any:
        try:
            reply = pickle.load(self._stdout)
        except EOFError:
            raise self._died() from None
        if isinstance(reply, _Failure):
            self.abort()
            raise reply.error
        return reply

    def _died(self) -> ExportError:
        code = self._process.wait()
        self.abort()
        return ExportError(f"the process writing {self._name} exited with status {code}")

    def _external(self, offset: int, length: int, tensor: ir.TensorProtocol) -> ir.ExternalTensor:
        return ir.ExternalTensor(
            self._name, offset, length, tensor.dtype, shape=ir.Shape(tensor.shape.numpy()),
            name=tensor.name or "", base_dir=self._base_dir,
        )  # fmt: skip

    def wait_for_plans(self, progress: Callable[[int, int], None] = lambda i, n: None) -> int:
        """Waits until every planned weight is written; returns how many there were."""
        if self._written is None:
            self._written = {}
            for i, plan in enumerate(self.plans, 1):
                self._written[plan] = self._receive()
                progress(i, len(self.plans))
        return len(self._written)

    def reuse(self, tensor: ir.TensorProtocol) -> ir.ExternalTensor | None:
        """The already written copy of `tensor`, named for the graph, or None."""
        if not isinstance(tensor, StreamedTensor):
            return None
        self.wait_for_plans()
        assert self._written is not None  # wait_for_plans filled it
        plan = PlannedWeight(tensor.keys, tensor.is_transposed)
        done = self._written.get(plan)
        if done is None or tuple(tensor.shape) != _plan_shape(tensor.tensors, plan):
            return None
        return self._external(*done, tensor)

    def append(self, tensor: ir.TensorProtocol) -> ir.ExternalTensor:
        """Writes `tensor` at the end; returns the reference that replaces it in a graph."""
        self.wait_for_plans()
        if isinstance(tensor, StreamedTensor):
            shape = tensor.shape.numpy()
            self._send(_Streamed(tensor.keys, tensor.is_transposed, shape, tensor.name or ""))
        else:
            self._send(_Bytes(tensor.tobytes()))
        offset, length = self._receive()
        if length != tensor.nbytes:
            raise RuntimeError(f"{tensor.name}: wrote {length} bytes, expected {tensor.nbytes}")
        return self._external(offset, length, tensor)

    def close(self) -> str:
        """Renames the file into place; returns its sha256."""
        self.wait_for_plans()
        self._send(_CLOSE)
        digest = self._receive()
        self._stdin.close()
        self._process.wait()
        return digest

    def __enter__(self) -> WeightWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.abort()  # after close() only reaps the process: the file is in place

    def abort(self) -> None:
        """Stops the child and removes the partial file."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        for stream in (self._stdin, self._stdout):
            stream.close()
        self.temporary.unlink(missing_ok=True)


def _serve(inbox: BinaryIO, outbox: BinaryIO) -> None:
    """The child: writes the plans, then appends until told to close."""

    def send(message: Any) -> None:
        pickle.dump(message, outbox, protocol=pickle.HIGHEST_PROTOCOL)
        outbox.flush()

    data, scratch = None, Scratch()
    try:
        setup: _Setup = pickle.load(inbox)  # opens the checkpoint's files again

        def streamed(keys, transposed, shape, name) -> StreamedTensor:
            return StreamedTensor(setup.tensors, keys, transposed, shape, name, scratch)

        data = DataFile(setup.directory, setup.name)
        for plan in setup.plans:
            shape = _plan_shape(setup.tensors, plan)
            written = data.append(streamed(plan.keys, plan.transposed, shape, ""))
            send((written.offset, written.length))
        while (request := pickle.load(inbox)) != _CLOSE:
            offset = data.position
            if isinstance(request, _Streamed):
                tensor = streamed(request.keys, request.transposed, request.shape, request.name)
                data.append(tensor)
            else:
                data.write(request.data)
            send((offset, data.position - offset))
        send(data.close())
    except EOFError:  # the parent is gone (its abort kills us first)
        if data is not None:
            data.abort()
        raise SystemExit(1) from None
    except BaseException as e:
        if data is not None:
            data.abort()
        try:
            send(_Failure(e))
        except Exception:  # an unpicklable error, or the parent is gone
            send(_Failure(RuntimeError(repr(e))))
        raise SystemExit(1) from None


if __name__ == "__main__":
    # The protocol owns the real stdout; anything printed goes to stderr. The messages'
    # classes must pickle as this module's, not as __main__'s.
    from specx.export import weight_writer

    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    weight_writer._serve(sys.stdin.buffer, protocol)
