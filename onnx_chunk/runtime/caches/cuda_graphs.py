"""CUDA graph capture: which sessions capture, the run options per graph id, the capture gate.

ONNX Runtime's CUDA provider captures CUDA graphs when a session is created with the provider
option `enable_cuda_graph=1`. Since ONNX Runtime 1.18 one session holds several graphs, each
under its own annotation id (the run option `gpu_graph_id`) with its own fixed shapes and
addresses; a run with id -1 runs without capture, and `release_captured_graph(id)` frees one.
What ONNX Runtime requires, and how the runtime meets it (docs/cuda.md has the whole story):

1. Every input and output is bound through IOBinding to an OrtValue on the device that never
   moves: replay re-issues the addresses recorded at capture and skips the input copies.
2. Shapes and addresses are fixed per graph id: each binding (one slot's buffers at one width
   and batch) that captures gets ids of its own from the graph cache (`graph_cache`), never
   shared with another binding. Widths that do not capture run under SKIP_CAPTURE on the same
   session.
3. Every compute node runs on the CUDA provider; a session that cannot capture fails to be
   created with the option on, and the factory creates it without.
4. Graph id 0 is ONNX Runtime's default, the id of a run without `gpu_graph_id` (cuda_graph.h,
   `kCudaGraphAnnotationDefault`): ids start at FIRST_GRAPH_ID, and a run without options on
   a capturing session runs under SKIP_CAPTURE (`device.run_lock.options_for`). The first user run
   under a graph id IS its capture: `InferenceSession::Run`
   (onnxruntime/core/session/inference_session.cc, "Start another run for necessary memory
   allocation or graph capture.") calls itself until the graph of that id is captured, so that
   one call does the CUDA provider's warm-up runs (cuda_execution_provider.cc,
   `min_num_runs_before_cuda_graph_capture_`), the capture and a replay. Every later run under
   the id replays. A binding's very first run passes SKIP_CAPTURE (it learns the logits
   shape). `GraphRuns` counts the runs, so the runtime knows which run captures: that run holds
   the gate alone, is measured, and is the one the fallback wraps.
5. A model with recurrent state gets two ids per binding: its state buffers alternate.
6. ONNX Runtime captures in CUDA's global capture mode, which any device work from another
   thread breaks: a capture run holds `CAPTURE_GATE` alone, all other device work shares it
   (`device.capture_gate`: allocations, frees and copies of the runtime's buffers included).
7. Graphs live as long as their session on the CUDA provider (cuda_graph.cc: "Currently all
   the captured graphs will be tied to the session's lifecycle"): `release_graphs` calls
   `InferenceSession.release_captured_graph` only where the installed ONNX Runtime has it
   (1.30.0 on, measured on the wheels; detected once) and the provider frees graphs
   (`releases_graphs`); elsewhere no call
   is made. The graph cache bounds what is alive by a plan made at load (`graph_cache`).
8. One run at a time on a capturing session (`device.run_lock`, taken by `Device.run`).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from dataclasses import dataclass, field

import onnxruntime as ort

# The gate and the run options live in the device layer, which allocations use too; they are
# named here as well, where the rest of the graph rules are.
from onnx_chunk.runtime.device.capture_gate import CAPTURE_GATE as CAPTURE_GATE
from onnx_chunk.runtime.device.capture_gate import CaptureGate as CaptureGate
from onnx_chunk.runtime.device.provider import Device, MaskPolicy
from onnx_chunk.runtime.device.run_lock import GRAPH_ID_KEY as GRAPH_ID_KEY
from onnx_chunk.runtime.device.run_lock import SKIP_CAPTURE, run_options

logger = logging.getLogger(__name__)

ENABLE_CUDA_GRAPH = "enable_cuda_graph"
# ONNX Runtime reserves graph id 0 ("users are not expected to set the value to 0",
# onnxruntime_run_options_config_keys.h); its own tests and onnxruntime-genai start at 1.
FIRST_GRAPH_ID = 1
# The index of the user run under a graph id that captures it: the first one (see rule 4).
CAPTURE_RUN = 0


def capturable(device: Device) -> bool:
    """Whether the sessions of `device` are created to capture CUDA graphs (every one of them,
    the shape-generic one included: the bindings decide which shapes capture)."""
    return device.cuda_graphs and device.mask_policy is MaskPolicy.CAPACITY


def session_captures(session: ort.InferenceSession) -> bool:
    """Whether `session` was created with CUDA graph capture on (as ONNX Runtime reports it)."""
    options = session.get_provider_options().get("CUDAExecutionProvider", {})
    return options.get(ENABLE_CUDA_GRAPH) == "1"


@dataclass
class GraphRuns:
    """The run options of one binding: a first run without capture, then its graphs.

    `runs[i]` counts the user runs made under graph `ids[i]`: run CAPTURE_RUN (the first) is
    the capture, every later one a replay. The CUDA provider keeps its graphs per thread
    (cuda_execution_provider.cc, `PerThreadContext`), so a run in another thread than the one
    that captured `ids[i]` (`owners[i]`, held weakly), or after `claim`, may capture again: it
    is run as a capture (gate alone, measured, the fallback around it). `failure` (set by
    `fall_back`: a capture failed, the binding is outside the plan, its slot was freed) makes
    every later run skip capture.
    """

    first: ort.RunOptions
    by_parity: tuple[ort.RunOptions, ...]
    ids: tuple[int, ...]
    runs: list[int] = field(default_factory=list)
    moved: list[bool] = field(default_factory=list)
    owners: list[weakref.ref | None] = field(default_factory=list)
    failure: str | None = None

    def __post_init__(self) -> None:
        if not self.runs:
            self.runs = [0] * len(self.ids)
        if not self.moved:
            self.moved = [False] * len(self.ids)
        if not self.owners:
            self.owners = [None] * len(self.ids)

    def options(self, first_run: bool, parity: int) -> ort.RunOptions:
        """The options of a run: no capture on the binding's first run, else its graph."""
        if first_run or self.failure is not None:
            return self.first
        return self.by_parity[parity % len(self.by_parity)]

    def captures_next(self, first_run: bool, parity: int) -> bool:
        """Whether the next run (at `parity`, in this thread) is one that captures."""
        if first_run or self.failure is not None:
            return False
        return self._capturing(parity % len(self.ids))

    def ran(self, first_run: bool, parity: int) -> bool:
        """Count a finished run (in this thread); True when it was the first capture of its
        id."""
        if first_run or self.failure is not None:
            return False
        index = parity % len(self.ids)
        if self._capturing(index):
            self.owners[index] = weakref.ref(threading.current_thread())
        self.runs[index] += 1
        self.moved[index] = False
        return self.runs[index] == CAPTURE_RUN + 1

    def _capturing(self, index: int) -> bool:
        if self.runs[index] == CAPTURE_RUN or self.moved[index]:
            return True
        owner = self.owners[index]
        return owner is None or owner() is not threading.current_thread()

    def replays_next(self, first_run: bool, parity: int) -> bool:
        """Whether the next run (at `parity`) replays a captured graph."""
        return (not first_run and self.failure is None
                and not self.captures_next(first_run, parity))

    def graph(self, parity: int) -> int:
        """The graph id of runs at `parity`."""
        return self.ids[parity % len(self.ids)]

    @property
    def captured(self) -> tuple[int, ...]:
        """The graph ids captured so far."""
        return tuple(i for i, count in zip(self.ids, self.runs) if count > CAPTURE_RUN)

    def claim(self) -> None:
        """The binding runs in a new thread from now on: each captured id's next run is run
        as a capture (see the class docstring)."""
        self.moved = [count > CAPTURE_RUN for count in self.runs]

    def fall_back(self, reason: str) -> None:
        """Run without a graph from now on (`reason`)."""
        self.failure = reason


def graph_runs(ids: tuple[int, ...]) -> GraphRuns:
    """The run options of a binding whose graphs run under `ids` (one, two for a model whose
    state buffers alternate)."""
    if not ids or min(ids) < FIRST_GRAPH_ID:
        raise ValueError(f"graph ids start at {FIRST_GRAPH_ID}, got {ids}")
    return GraphRuns(run_options(SKIP_CAPTURE), tuple(run_options(i) for i in ids), ids)


def uncaptured(reason: str = "never captures") -> GraphRuns:
    """The run options of a binding on a capturing session that must never capture."""
    return GraphRuns(run_options(SKIP_CAPTURE), (), (), failure=reason)


# Providers whose captured graphs `release_captured_graph` really frees. The CUDA provider is
# not one: its graphs live as long as the session (cuda_graph.cc, "Currently all the captured
# graphs will be tied to the session's lifecycle"), and onnxruntime-gpu 1.31.1's Python method
# says providers without release support treat it as a no-op. Empty until a provider the
# runtime captures on frees its graphs.
RELEASING_PROVIDERS: frozenset[str] = frozenset()


@functools.lru_cache(maxsize=1)
def release_method() -> bool:
    """Whether the installed ONNX Runtime has `InferenceSession.release_captured_graph` (1.30.0
    and later on the wheels; detected once)."""
    return callable(getattr(ort.InferenceSession, "release_captured_graph", None))


def releases_graphs(session: ort.InferenceSession) -> bool:
    """Whether releasing a graph captured on `session` frees it: the method exists and the
    session's first provider is one that frees graphs."""
    if not release_method():
        return False
    providers = session.get_providers()
    return bool(providers) and providers[0] in RELEASING_PROVIDERS


def release_graphs(session: ort.InferenceSession, ids: tuple[int, ...]) -> int:
    """Free the graphs `ids` captured on `session` where ONNX Runtime frees them (see
    `releases_graphs`); how many were released (0 elsewhere: they go with the session, and no
    call is made, so no warning per call).

    A release ONNX Runtime refuses is logged and skipped: the graph is then freed with its
    session.
    """
    if not ids or not releases_graphs(session):
        return 0
    released = 0
    for graph in ids:
        try:
            session.release_captured_graph(graph)
        except Exception as error:  # ORT's own exception types
            logger.warning("ONNX Runtime could not release CUDA graph %d: %s", graph, error)
            continue
        released += 1
    return released


class SlotNumbers:
    """The graph slot numbers in use: each new holder gets the smallest free one."""

    def __init__(self) -> None:
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            slot = next(i for i in range(len(self._used) + 1) if i not in self._used)
            self._used.add(slot)
            return slot

    def give(self, slot: int) -> None:
        with self._lock:
            self._used.discard(slot)

    @property
    def used(self) -> int:
        """Slots held now."""
        return len(self._used)


