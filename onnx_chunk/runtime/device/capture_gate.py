"""The capture gate: keeps every other thread's device work out of a CUDA graph capture.

ONNX Runtime's CUDA provider captures in CUDA's global capture mode
(onnxruntime/core/providers/cuda/cuda_graph.cc, `CUDAGraphManager::CaptureBegin`:
`cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal)`; read at onnxruntime main,
multi-graph version), in which a potentially unsafe call from any thread of the process (a
cudaMalloc, a cudaFree, a synchronous cudaMemcpy or cudaMemset) invalidates the capture. Rules:

1. A capture run holds the gate alone (`exclusive`); the thread holding it is its owner.
2. Every other piece of device work holds it shared (`shared`): a forward, a session build, a
   graph release, and, by construction, every allocation, free and copy of the runtime's own
   buffers (`allocation`, `buffers`), whichever thread asks for them. The owner's own device
   work passes (its capture run is over, or has not begun, whenever it does any).
3. A shared holder never waits for a waiting capture (a thread holding the cache's build lock
   may be waiting to share), so a capture waits until no other device work is under way.
4. A free that arrives while another thread captures (a DLPack deleter runs wherever ONNX
   Runtime drops its last reference) is deferred, not blocked: the capture's owner runs it as
   it gives the gate back (`outside_capture`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class CaptureGate:
    """Keeps device work of other threads out of a CUDA graph capture (the rules above)."""

    def __init__(self) -> None:
        # An RLock: a DLPack deleter may run (through the garbage collector) in a thread that
        # holds the condition already.
        self._cond = threading.Condition(threading.RLock())
        self._shared = 0
        self._owner: threading.Thread | None = None
        self._deferred: list[Callable[[], None]] = []

    def _owned_here(self) -> bool:
        return self._owner is threading.current_thread()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            if self._owned_here():
                owner = True
            else:
                owner = False
                while self._owner is not None:
                    self._cond.wait()
                self._shared += 1
        try:
            yield
        finally:
            if not owner:
                with self._cond:
                    self._shared -= 1
                    if self._shared == 0:
                        self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            if self._owned_here():
                raise RuntimeError("a capture may not begin inside another capture")
            while self._owner is not None or self._shared:
                self._cond.wait()
            self._owner = threading.current_thread()
        try:
            yield
        finally:
            # Frees deferred during the capture run here, before any other thread's capture
            # may begin (the owner still holds the gate).
            with self._cond:
                deferred, self._deferred = self._deferred, []
            try:
                for action in deferred:
                    action()
            finally:
                with self._cond:
                    self._owner = None
                    self._cond.notify_all()

    def outside_capture(self, action: Callable[[], None]) -> None:
        """Run `action` (a free) now, as shared device work, or, while another thread
        captures, when that capture gives the gate back (rule 4)."""
        with self._cond:
            if self._owner is not None and not self._owned_here():
                self._deferred.append(action)
                return
            owner = self._owned_here()
            if not owner:
                self._shared += 1
        try:
            action()
        finally:
            if not owner:
                with self._cond:
                    self._shared -= 1
                    if self._shared == 0:
                        self._cond.notify_all()

    @property
    def capturing(self) -> bool:
        """Whether a capture holds the gate now."""
        return self._owner is not None

    @property
    def held(self) -> bool:
        """Whether anything (a capture, or device work sharing the gate) holds it now."""
        with self._cond:
            return self._owner is not None or self._shared > 0


# One gate per process: CUDA's global capture mode spans every stream and thread.
CAPTURE_GATE = CaptureGate()
