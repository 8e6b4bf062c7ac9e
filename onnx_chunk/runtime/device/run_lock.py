"""One run at a time on a session that captures CUDA graphs, and the run options of its runs.

A replay writes its intermediates at the addresses recorded at capture, which the session's
arena considers free between runs; every run of a CUDA session goes to the one stream of its
provider (onnxruntime/core/providers/cuda/cuda_execution_provider.cc), and ONNX Runtime's Python
binding releases the GIL during a run (onnxruntime/python/onnxruntime_pybind_state.cc). Two
threads running one capturing session at once could therefore clobber each other's
intermediates, and a replay could overwrite an output ONNX Runtime allocated in that arena for
an uncaptured run, in the time between that run and the read of its output. Rules:

1. Each capturing session gets a lock of its own (`serialise_runs`, when it is built), and
   `Device.run` holds it around every run of that session (`run_lock`) and around whatever
   reads or releases that run's outputs (`Device.run`'s `then`).
2. A run without run options on a capturing session would capture under graph id 0, ONNX
   Runtime's default annotation id (cuda_graph.h, `kCudaGraphAnnotationDefault = 0`;
   onnxruntime_inference_collection.py, `_graph_annotation_id`: "defaulting to 0 when unset",
   1.32): `options_for` gives such a run `SKIP_CAPTURE` instead.
3. Sessions that do not capture run concurrently as ONNX Runtime allows.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import onnxruntime as ort

# The run option that selects a graph (onnxruntime_run_options_config_keys.h,
# kOrtRunOptionsConfigCudaGraphAnnotation); -1 runs without capture or replay.
GRAPH_ID_KEY = "gpu_graph_id"
SKIP_CAPTURE = -1

_LOCKS: weakref.WeakKeyDictionary[ort.InferenceSession, threading.Lock] = (
    weakref.WeakKeyDictionary())
_GUARD = threading.Lock()


def run_options(graph: int) -> ort.RunOptions:
    """Run options that select graph `graph` (SKIP_CAPTURE: run without capture)."""
    options = ort.RunOptions()
    options.add_run_config_entry(GRAPH_ID_KEY, str(graph))
    return options


_UNCAPTURED = run_options(SKIP_CAPTURE)


def serialise_runs(session: ort.InferenceSession) -> None:
    """Make every run of `session` (a capturing one) hold a lock of its own."""
    with _GUARD:
        _LOCKS.setdefault(session, threading.Lock())


def captures(session: ort.InferenceSession) -> bool:
    """Whether `session` was registered as capturing (`serialise_runs`)."""
    return session in _LOCKS


def run_lock(session: ort.InferenceSession) -> contextlib.AbstractContextManager:
    """The lock a run of `session` holds: its own for a capturing session, else none."""
    lock = _LOCKS.get(session)
    return contextlib.nullcontext() if lock is None else lock


def options_for(session: ort.InferenceSession,
                options: ort.RunOptions | None) -> ort.RunOptions | None:
    """`options`, or, for a run without options on a capturing session, SKIP_CAPTURE (rule 2)."""
    if options is None and session in _LOCKS:
        return _UNCAPTURED
    return options
