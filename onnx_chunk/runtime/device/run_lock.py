"""One run at a time on a session that captures CUDA graphs.

A replay writes its intermediates at the addresses recorded at capture, which the session's
arena considers free between runs; every run of a CUDA session goes to the one stream of its
provider (onnxruntime/core/providers/cuda/cuda_execution_provider.cc), and ONNX Runtime's Python
binding releases the GIL during a run (onnxruntime/python/onnxruntime_pybind_state.cc). Two
threads running one capturing session at once could therefore clobber each other's
intermediates. Each capturing session gets a lock of its own (`serialise_runs`, when it is
built), and `Device.run` holds it around every run of that session (`run_lock`). Sessions that
do not capture run concurrently as ONNX Runtime allows.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import onnxruntime as ort

_LOCKS: weakref.WeakKeyDictionary[ort.InferenceSession, threading.Lock] = (
    weakref.WeakKeyDictionary())
_GUARD = threading.Lock()


def serialise_runs(session: ort.InferenceSession) -> None:
    """Make every run of `session` (a capturing one) hold a lock of its own."""
    with _GUARD:
        _LOCKS.setdefault(session, threading.Lock())


def run_lock(session: ort.InferenceSession) -> contextlib.AbstractContextManager:
    """The lock a run of `session` holds: its own for a capturing session, else none."""
    lock = _LOCKS.get(session)
    return contextlib.nullcontext() if lock is None else lock
