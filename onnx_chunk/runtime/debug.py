"""A look inside the runtime for scripts and diagnosis, beside the facade: not a stable API.

`Runtime.debug` shows a loaded runtime's parts (a `RuntimeDebug`). This module names the rest a
diagnostic script reads or builds: the device layer's own checks, which run before or without a
runtime (the CUDA probe, libcudart, the memory meters, whether the runtime's own buffers bind in
place, the record that native chunks were verified on a build, what the installed ONNX Runtime
lacks for the CUDA path), the session factory a check builds extra sessions with, the variant
key of a width, and two stand-ins: every session counted as capturing CUDA graphs (a CPU dry run
of a GPU check) and the prefill batching rule replaced (a benchmark's arms).

Scripts import the runtime through the facade and this module only
(tests/test_scripts_are_clients.py): when the runtime's insides move, this module follows them,
and no script has to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

from onnx_chunk._onnxruntime_wheels import cuda_api_gaps, cuda_install_command
from onnx_chunk.runtime.caches import variant_pool
from onnx_chunk.runtime.caches.variant_cache import variant_key
from onnx_chunk.runtime.device.allocation import ALLOCATIONS
from onnx_chunk.runtime.device.identity import bind_time_copy
from onnx_chunk.runtime.device.identity import forget as forget_binding_checks
from onnx_chunk.runtime.device.identity import record as record_binding_check
from onnx_chunk.runtime.device.memory import (
    cudart,
    cudart_candidates,
    mapped_cudart,
    meter_for,
    ort_cudart_soname,
)
from onnx_chunk.runtime.device.native_trust import record_verified
from onnx_chunk.runtime.device.provider import device_for, probe_cuda
from onnx_chunk.runtime.device.session_factory import SessionFactory, SharedWeights
from onnx_chunk.runtime.engine import plan_runner
from onnx_chunk.runtime.facade import RuntimeDebug

__all__ = ["RuntimeDebug", "SessionFactory", "SharedWeights", "bind_time_copy", "cuda_api_gaps",
           "cuda_install_command", "cudart", "cudart_candidates", "device_for",
           "forget_binding_checks", "live_buffers", "mapped_cudart", "meter_for",
           "ort_cudart_soname", "prefill_batching", "probe_cuda", "record_binding_check",
           "record_verified", "sessions_count_as_capturing", "variant_key"]


def live_buffers() -> int:
    """How many device buffers the runtime allocated itself and holds now (process-wide)."""
    return ALLOCATIONS.live_buffers


@contextlib.contextmanager
def _replaced(module: ModuleType, name: str, value: object) -> Iterator[None]:
    """`module.name` is `value` in the block (an AttributeError here: the runtime's insides
    moved, and this module must follow them)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def sessions_count_as_capturing() -> contextlib.AbstractContextManager[None]:
    """In the block, every session built to capture counts as capturing CUDA graphs: a CPU dry
    run of a GPU check (the CPU device marked not host-visible, with the capacity mask and CUDA
    graphs on) runs the graph bookkeeping as on CUDA, though a CPU session captures nothing."""
    return _replaced(variant_pool, "session_captures", lambda session: True)


def prefill_batching(rule: Callable[[Sequence[int], int], bool]
                     ) -> contextlib.AbstractContextManager[None]:
    """In the block, the batch engine runs one round's prefill chunks of several slots in one
    forward where `rule(widths, slots)` says so, in place of the scheduler's `batch_pays` (a
    benchmark's arms: always, never)."""
    return _replaced(plan_runner, "batch_pays", rule)
