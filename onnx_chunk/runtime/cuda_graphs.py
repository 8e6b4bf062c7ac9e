"""CUDA graph capture per variant: which sessions capture, and the graph id each run replays.

ONNX Runtime's CUDA provider captures a CUDA graph when a session is created with the provider
option `enable_cuda_graph=1`; every later run with the same run option `gpu_graph_id` replays
it without launching a kernel from the host. What ONNX Runtime requires, and how the runtime
meets it:

1. Every input and output is bound through IOBinding to an OrtValue on the device that never
   moves: replay re-issues the addresses recorded at capture and skips the input copies. The
   runtime binds KV, tokens, positions, the capacity-wide mask and the logits once per binding
   and updates them in place (`OrtValue.update_inplace`).
2. Shapes are fixed per graph: a session specialised for one query width (the ladder tiers,
   the decode width, every width under `specialize="exact"`) with the capacity-wide mask.
   The shape-generic session never captures, nor does any session under the logical mask,
   whose width changes every step.
3. Every compute node runs on the CUDA provider (shape-only nodes on the CPU are allowed, a
   Memcpy node is not). A session that cannot capture fails to be created with the option on;
   the factory then creates it without and logs why.
4. The provider runs a graph id's first runs without capture (they allocate what the graph
   will use), captures the next and replays from then on. The graph lives in the calling
   thread's context, so a sequence driven from another thread captures its own copy.
5. A graph records one set of addresses, so each sequence gets its own graph ids on a session
   (one slot per sequence and session), and a model with recurrent state gets two per slot:
   its state buffers alternate between two addresses (see `buffers`), one graph per parity.
6. The first run of a binding passes `gpu_graph_id=-1` (no capture): it learns the logits
   shape, after which the logits are bound to a buffer of their own for good.

One session per variant, each specialised to its width (free-dimension overrides) and
released with the variant on eviction. The cost, found in review and not yet measured on a
GPU: `add_initializer` accepts only caller-owned buffers, so the sessions share the weights in
host memory and each CUDA session holds its own device copy. One device copy for every width
needs the other design ONNX Runtime offers since 1.18: one shape-generic session that keeps a
graph per annotation id (`gpu_graph_id`), shapes fixed per id; whether a captured graph can
then be released on eviction is what a GPU run has to establish (docs/cuda.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import onnxruntime as ort

from onnx_chunk.runtime.provider import Device, MaskPolicy

GRAPH_ID_KEY = "gpu_graph_id"
ENABLE_CUDA_GRAPH = "enable_cuda_graph"
SKIP_CAPTURE = -1


def capturable(device: Device, width: int | None) -> bool:
    """Whether a variant of query width `width` (None: shape-generic) captures a CUDA graph."""
    return (device.cuda_graphs and device.mask_policy is MaskPolicy.CAPACITY
            and width is not None)


def session_captures(session: ort.InferenceSession) -> bool:
    """Whether `session` was created with CUDA graph capture on (as ONNX Runtime reports it)."""
    options = session.get_provider_options().get("CUDAExecutionProvider", {})
    return options.get(ENABLE_CUDA_GRAPH) == "1"


def graph_id(slot: int, parity: int, stateful: bool) -> int:
    """The graph id of a binding in `slot` whose state buffers are at `parity` (0 or 1)."""
    if slot < 0 or parity not in (0, 1):
        raise ValueError(f"slot must be >= 0 and parity 0 or 1, got {slot} and {parity}")
    return 2 * slot + parity if stateful else slot


def run_options(graph: int) -> ort.RunOptions:
    """Run options that select graph `graph` (SKIP_CAPTURE: run without capture)."""
    options = ort.RunOptions()
    options.add_run_config_entry(GRAPH_ID_KEY, str(graph))
    return options


@dataclass(frozen=True)
class GraphRuns:
    """The run options of one binding: a first run without capture, then its graphs."""

    first: ort.RunOptions
    by_parity: tuple[ort.RunOptions, ...]
    ids: tuple[int, ...]

    def options(self, first_run: bool, parity: int) -> ort.RunOptions:
        """The options of a run: no capture on the binding's first run, else its graph."""
        if first_run:
            return self.first
        return self.by_parity[parity % len(self.by_parity)]


class GraphSlots:
    """Hands out graph slots on one session, one per binding that captures."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def runs(self, stateful: bool) -> GraphRuns:
        """The run options of a new binding on this session."""
        with self._lock:
            slot = self._next
            self._next += 1
        ids = tuple(graph_id(slot, parity, stateful) for parity in ((0, 1) if stateful else (0,)))
        return GraphRuns(run_options(SKIP_CAPTURE), tuple(run_options(i) for i in ids), ids)

    @property
    def used(self) -> int:
        """Slots handed out so far."""
        return self._next
