"""Fixtures of the CUDA-path tests (run on CPU)."""

import ctypes
import threading
import time
import weakref

import onnxruntime as ort
import pytest

from onnx_chunk.runtime.caches import cuda_graphs
from onnx_chunk.runtime.device import allocation

try:  # the device's binding check (a runtime without one runs these tests to fail them)
    from onnx_chunk.runtime.device import identity
except ImportError:
    identity = None


@pytest.fixture
def recorded_runs(monkeypatch):
    """Every run_with_iobinding: (session id, graph id or None without run options)."""
    runs = []
    original = ort.InferenceSession.run_with_iobinding

    def run(self, iobinding, run_options=None):
        runs.append((id(self), None if run_options is None
                     else int(run_options.get_run_config_entry("gpu_graph_id"))))
        return original(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    return runs


@pytest.fixture
def gated_runs(monkeypatch):
    """Every run_with_iobinding: (session id, graph id or None, whether a capture held the
    gate)."""
    runs = []
    original = ort.InferenceSession.run_with_iobinding

    def run(self, iobinding, run_options=None):
        graph = (None if run_options is None
                 else int(run_options.get_run_config_entry("gpu_graph_id")))
        runs.append((id(self), graph, cuda_graphs.CAPTURE_GATE.capturing))
        return original(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    return runs


class GraphRunsModel:
    """A recording fake of ONNX Runtime's CUDA graph bookkeeping around the real CPU runs.

    What it models, each from ONNX Runtime's source (docs/cuda.md names the files):

    1. Capture: as `InferenceSession::Run` does (onnxruntime/core/session/inference_session.cc,
       "Start another run for necessary memory allocation or graph capture."), the first user
       run under a graph id not yet captured in the running thread's provider context is
       WARM_UPS regular runs, the capture and a replay, all inside that one call (`internal`
       records each); later user runs under the id replay. Graphs are kept per (session, id,
       thread), as the CUDA provider keeps them per thread context. Only the runs of sessions
       the runtime built to capture (`sessions`: those it asked `session_captures` about) are
       modelled (and recorded);
       on them a run without run options runs under graph id 0, ONNX Runtime's default
       (`kCudaGraphAnnotationDefault`).
    2. Release: `release_captured_graph` is a no-op (as on the CUDA provider: cuda_graph.cc ties
       graphs to the session) unless `releases` is set; every call is recorded in `released`.
       `alive` holds the graphs captured and not freed.
    3. Bind-time copies (`copies_at_bind`): an OrtValue made by `OrtValue.from_dlpack` is bound
       as a copy taken at bind time, as `IOBinding::BindInput` does for a value whose device
       differs from the session's (measured: ORT's "no data transfer registered for copying
       tensors" error comes from bind_ortvalue_input). `bind_copies` counts them.
    4. Addresses: every input and output address a binding holds is recorded; a graph's
       replay with any address other than at its capture, or a capture with an output ONNX
       Runtime allocates, is a violation (replay re-issues the captured addresses).
    5. The arena: a replay on a session writes over the outputs ONNX Runtime allocated for
       other bindings' runs of that session and that are still bound (a captured graph's
       intermediates sit at addresses the arena hands out again); `clobbered` counts them.
       `read_delay` (seconds) keeps each `get_outputs` a while, so that a read of such an
       output outside the run lock meets a replay.
    6. Device work during a capture: an allocation or free of the runtime's own buffers
       (`allocation.ALLOCATIONS`) from another thread while a capture is in flight is a
       violation (CUDA's global capture mode fails on it, cuda_graph.cc).

    `violations` lists what ONNX Runtime would not allow: those above, a capture beside another
    run, two runs of one session at once, a run of a released graph id, a release of a graph
    never captured, a capture under graph 0. `delay` (seconds) keeps each run in flight a while,
    so that runs of several threads overlap.
    """

    WARM_UPS = 2

    def __init__(self) -> None:
        self.runs: list[tuple[int, int | None]] = []
        self.internal: list[tuple[int, int, str]] = []
        self.captured: set[tuple[int, int, object]] = set()
        self.alive: set[tuple[int, int]] = set()
        self.gone: set[tuple[int, int]] = set()
        self.released: list[int] = []
        self.captures: list[tuple[int, int]] = []
        self.peak_alive = 0
        self.violations: list[str] = []
        self.delay = 0.0
        self.read_delay = 0.0
        self.releases = False
        self.copies_at_bind = False
        self.bind_copies = 0
        self.clobbered = 0
        self.fail_capture: set[int] = set()
        self.capturing: threading.Thread | None = None
        # Per IOBinding (its id): the addresses bound, by (direction, name); None for an output
        # ONNX Runtime allocates. At each capture: a copy, by (session, graph, thread).
        self.addresses: dict[int, dict[tuple[str, str], int | None]] = {}
        self.at_capture: dict[tuple[int, int, object], dict[tuple[str, str], int | None]] = {}
        self.bindings: dict[int, set] = {}
        self.dlpack: weakref.WeakSet = weakref.WeakSet()
        self.sessions: weakref.WeakSet = weakref.WeakSet()
        self._in_flight = 0
        self._per_session: dict[int, int] = {}
        self._lock = threading.Lock()

    def run(self, session, graph: int | None, iobinding=None) -> None:
        if session not in self.sessions:  # a session the runtime does not capture on
            return
        if graph is None:
            graph = 0
        key = (id(session), graph)
        # The thread object, not its ident: an ident is reused by a later thread, an ONNX
        # Runtime thread_local context is not.
        thread = threading.current_thread()
        captures = False
        with self._lock:
            self.runs.append(key)
            self._in_flight += 1
            self._per_session[id(session)] = self._per_session.get(id(session), 0) + 1
            if self._per_session[id(session)] > 1:
                self.violations.append(f"two runs of session {id(session)} at once")
            bound = dict(self.addresses.get(id(iobinding), {}))
            if iobinding is not None:
                self.bindings.setdefault(id(session), weakref.WeakSet()).add(iobinding)
            if graph != cuda_graphs.SKIP_CAPTURE:
                if graph == 0:
                    self.violations.append("a run without run options captured graph 0")
                if key in self.gone:
                    self.violations.append(f"graph {graph} ran after its release")
                if (id(session), graph, thread) not in self.captured:
                    self.internal.extend([(id(session), graph, "regular")] * self.WARM_UPS)
                    if self._in_flight > 1:
                        self.violations.append(f"graph {graph} captured beside another run")
                    if graph in self.fail_capture:
                        self._leave(session)
                        raise RuntimeError("operation not permitted when stream is capturing")
                    allocated = [name for (way, name), at in bound.items()
                                 if way == "out" and at is None]
                    if allocated:
                        self.violations.append(f"graph {graph} captured with outputs ONNX "
                                               f"Runtime allocates: {allocated}")
                    self.internal.extend([(id(session), graph, "capture"),
                                          (id(session), graph, "replay")])
                    self.captured.add((id(session), graph, thread))
                    self.at_capture[(id(session), graph, thread)] = bound
                    self.captures.append(key)
                    self.alive.add(key)
                    self.peak_alive = max(self.peak_alive, len(self.alive))
                    self.capturing = thread
                    captures = True
                else:
                    self.internal.append((id(session), graph, "replay"))
                    moved = sorted(name for name, at in bound.items()
                                   if self.at_capture[(id(session), graph, thread)].get(name)
                                   != at)
                    if moved:
                        self.violations.append(f"graph {graph} replayed with {moved} at "
                                               "other addresses than at its capture")
                    self._clobber(session, iobinding)
        try:
            time.sleep(self.delay)
        finally:
            with self._lock:
                if captures:
                    self.capturing = None
                self._leave(session)

    def _clobber(self, session, replayed) -> None:
        """A replay writes over other bindings' outputs that ONNX Runtime allocated (rule 5)."""
        for other in list(self.bindings.get(id(session), ())):
            if other is replayed:
                continue
            owned = {at for (way, _), at in self.addresses.get(id(other), {}).items()
                     if way == "out"}
            for value in ORIGINAL_GET_OUTPUTS(other):
                if not value.is_tensor() or value.data_ptr() in owned:
                    continue
                ctypes.memset(value.data_ptr(), 0xFF, value.tensor_size_in_bytes())
                self.clobbered += 1

    def _leave(self, session) -> None:
        self._in_flight -= 1
        self._per_session[id(session)] -= 1

    def device_work(self, what: str) -> None:
        """An allocation or free of the runtime's own buffers, now (rule 6)."""
        capturing = self.capturing
        if capturing is not None and capturing is not threading.current_thread():
            self.violations.append(f"{what} during another thread's capture")

    def release(self, session, graph: int) -> None:
        key = (id(session), graph)
        with self._lock:
            self.released.append(graph)
            if key not in self.alive:
                self.violations.append(f"graph {graph} released but never captured")
            if self.releases:
                self.alive.discard(key)
                self.gone.add(key)
                self.captured = {held for held in self.captured if held[:2] != key}

    def user_runs(self, graph: int) -> int:
        return sum(1 for _, ran in self.runs if ran == graph)


ORIGINAL_GET_OUTPUTS = ort.IOBinding.get_outputs


def _addresses(model: GraphRunsModel, binding) -> dict:
    return model.addresses.setdefault(id(binding), {})


@pytest.fixture
def graph_model(monkeypatch):
    """`GraphRunsModel` around every run_with_iobinding and release_captured_graph, with every
    session counted as capturing (CPU sessions never capture); its provider frees graphs on
    release only once `model.releases` is set (the runtime then calls the release). It also
    wraps the IOBinding methods (addresses, bind-time copies, reads), OrtValue.from_dlpack and
    the runtime's allocation counters (device work during a capture)."""
    from onnx_chunk.runtime.caches import variant_pool

    model = GraphRunsModel()
    original = ort.InferenceSession.run_with_iobinding

    def run(self, iobinding, run_options=None):
        model.run(self, None if run_options is None
                  else int(run_options.get_run_config_entry("gpu_graph_id")), iobinding)
        return original(self, iobinding, run_options)

    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", run)
    monkeypatch.setattr(ort.InferenceSession, "release_captured_graph",
                        lambda self, graph: model.release(self, graph))
    def captures(session):
        model.sessions.add(session)
        return True

    monkeypatch.setattr(variant_pool, "session_captures", captures)
    monkeypatch.setattr(cuda_graphs, "releases_graphs", lambda session: model.releases)
    _wrap_bindings(monkeypatch, model)
    for name in ("added", "removed"):
        method = getattr(allocation.ALLOCATIONS, name)

        def counted(nbytes, method=method, name=name):
            model.device_work("an allocation" if name == "added" else "a free")
            return method(nbytes)

        monkeypatch.setattr(allocation.ALLOCATIONS, name, counted)
    # The device's binding check is made again under this fake's bind-time copies.
    forget = getattr(identity, "forget", lambda: None)
    forget()
    yield model
    forget()


def _wrap_bindings(monkeypatch, model: GraphRunsModel) -> None:
    binding_class = ort.IOBinding
    from_dlpack = ort.OrtValue.from_dlpack

    def imported(data):
        value = from_dlpack(data)
        model.dlpack.add(value)
        return value

    def bind_ortvalue_input(self, name, value, original=binding_class.bind_ortvalue_input):
        if model.copies_at_bind and value in model.dlpack:
            value = ort.OrtValue.ortvalue_from_numpy(value.numpy().copy())
            model.bind_copies += 1
        _addresses(model, self)[("in", name)] = value.data_ptr()
        return original(self, name, value)

    def bind_ortvalue_output(self, name, value, original=binding_class.bind_ortvalue_output):
        _addresses(model, self)[("out", name)] = value.data_ptr()
        return original(self, name, value)

    def bind_input(self, name, *args, original=binding_class.bind_input):
        _addresses(model, self)[("in", name)] = args[-1]
        return original(self, name, *args)

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None,
                    shape=None, buffer_ptr=None, original=binding_class.bind_output):
        _addresses(model, self)[("out", name)] = buffer_ptr
        return original(self, name, device_type, device_id, element_type, shape, buffer_ptr)

    def clear_binding_outputs(self, original=binding_class.clear_binding_outputs):
        held = _addresses(model, self)
        for bound in [bound for bound in held if bound[0] == "out"]:
            del held[bound]
        return original(self)

    def get_outputs(self):
        time.sleep(model.read_delay)
        return ORIGINAL_GET_OUTPUTS(self)

    monkeypatch.setattr(ort.OrtValue, "from_dlpack", staticmethod(imported))
    for name, method in (("bind_ortvalue_input", bind_ortvalue_input),
                         ("bind_ortvalue_output", bind_ortvalue_output),
                         ("bind_input", bind_input), ("bind_output", bind_output),
                         ("clear_binding_outputs", clear_binding_outputs),
                         ("get_outputs", get_outputs)):
        monkeypatch.setattr(binding_class, name, method)
