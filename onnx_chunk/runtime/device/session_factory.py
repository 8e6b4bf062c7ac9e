"""Session creation: every ONNX Runtime session of one model shares one copy of its weights.

The variant cache creates a session per query width, so a runtime that let each session read
the weights itself would hold them once per variant. Instead the external initializers are
loaded once, as OrtValues on the runtime's device (on CPU: copy-on-write memory maps of the
external data file, so untouched pages are not even resident), and handed to every session
through `SessionOptions.add_initializer`, which makes the session use that buffer in place.

Measured with ONNX Runtime 1.31 on CPU (a 45 MB fp32 decoder, four sessions of widths 1, 16,
32, 64; resident set growth per extra session):

1. `add_external_initializers` copies the data into every session ("the data will be copied
   into the graph", as its API documentation says): about +50 MB per session. Not used.
2. `add_initializer` shares the buffer, but kernels that pre-pack their constant weights (fp32
   MatMul, MatMulNBits) still make a packed copy per session: about +30 MB per session.
   ONNX Runtime can share pre-packed weights across sessions through a
   PrepackedWeightsContainer, but its Python API does not expose one.
3. `add_initializer` with pre-packing disabled: +1 to +4 MB per session (activations only).

For fp32 MatMul, pre-packing pays for itself on the decode shape (one row: 1.95 ms with,
3.6 ms without on that model) and not on prefill widths (64 rows: 18.7 ms with, 17.3 ms
without). So the decode session (and a lone shape-generic session, which also decodes)
pre-packs and every prefill session shares the weights as they are: one copy of the weights
plus one packed copy in all.

INT4 `com.microsoft::MatMulNBits` is different: without its packed layout the CPU kernel falls
back to a path that is far slower (the `small` reference decoder, INT4: one row 1.3 ms packed
against 12.6 ms unpacked, 64 rows 5.7 ms against 14.9 ms), and its packed copy is about as
small as the 4-bit weights themselves. Sessions of a model with MatMulNBits all pre-pack.

Sessions are specialised per width with `add_free_dimension_override_by_name`
(measured 3-8% faster on CPU than the dynamic session, 20-35 ms to create for a 4M-parameter
model).

The shared weights are the runtime's, not a variant's: on CPU they are faulted in (one byte read
per page) when they are loaded, with the resident set read around it (`SharedWeights.
resident_bytes`), so that a variant's build reading sees only what the variant adds. Before,
the first variant (the decode session, which pre-packs and so reads every weight) was charged
581 MiB on the bench decoder: its own 300 MiB packed copy plus 281 MiB of shared pages it
happened to fault in.

When the runtime holds one session only (the shape-generic mode, the CPU default), sharing buys
nothing: the factory is made without shared weights and the session loads its own the plain
way, pre-packs them and frees the originals (bench decoder after one decode step: 426 MiB
resident, a plain ORT session 392 MiB, per-width variants 804 MiB: 381 MiB of shared maps plus
a 295 MiB packed copy).

On CUDA the runtime holds one session per model (`specialize=False`, the default there), which
loads its own weights onto the device: one copy, with CUDA graphs per shape on it instead of a
session per width. Per-width CUDA sessions (`specialize=True` asked for) get the shared
OrtValues in host memory (`add_initializer` refuses a buffer ONNX Runtime allocated), and each
copies them to the device ("Cannot use user supplied initializer ... because the ORT planned
memory location for the initializer is different"): one device copy per session
(`SharedWeights.copied_per_session`), which its build reading charges to it. A session asked to
capture a CUDA graph that ONNX Runtime refuses to create (a compute node it cannot place on the
CUDA provider) is created again without capture, with a warning;
`cuda_graphs.session_captures` tells which.

Counted from events (`sessions_alive`, `weights_copies`): a session is alive from its creation
until ONNX Runtime's session object is freed (a `weakref.finalize` on it), and it owns a copy of
the weights when it loads its own (no shared weights), copies the shared host values to its
device, or pre-packs the shared values (a packed copy of the MatMul weights, as measured
above). The shared host values count as one copy while loaded and faulted in (on CPU).
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_chunk._onnxruntime_wheels import check_cuda_api
from onnx_chunk.errors import ConfigError, ModelLoadError, ProviderError
from onnx_chunk.graph.data_types import numpy_dtype, tensor_nbytes
from onnx_chunk.graph.logits_row import select_row
from onnx_chunk.graph.model_file import ExternalData, ModelFile, TensorRef
from onnx_chunk.runtime.device.memory import MemoryMeter, measured
from onnx_chunk.runtime.device.provider import Device

logger = logging.getLogger(__name__)

DISABLE_PREPACKING_KEY = "session.disable_prepacking"
# Where a model given as bytes finds its external data (the row-selecting sessions, a
# `graph` given to the runtime): onnxruntime_session_options_config_keys.h defines it for a
# model loaded from a memory buffer, every external data file in that one folder.
EXTERNAL_DATA_FOLDER_KEY = "session.model_external_initializers_file_folder_path"
_PAGE_SIZE = mmap.PAGESIZE
QUANTIZED_MATMUL = "MatMulNBits"


@dataclass(frozen=True)
class SharedWeights:
    """The external initializers of a model, loaded once as host OrtValues for every session.

    `nbytes`: their size; `resident_bytes`: what loading them (and, on CPU, faulting every page
    in) made the meter grow by, None without a meter or a reading. `owned_by_session` gives
    the weights of a runtime whose one session loads its own (no values, `shared` False).
    `copied_per_session`: the values are host memory and the sessions run on another device,
    so every session copies them to its device (one device copy per variant). `host_copy`:
    the values are a resident copy in host memory (on CPU, faulted in at load). `arrays`: the
    memory maps the values wrap, held as long as the values are.
    """

    names: tuple[str, ...]
    values: tuple[ort.OrtValue, ...]
    nbytes: int
    resident_bytes: int | None = None
    shared: bool = True
    copied_per_session: bool = False
    host_copy: bool = False
    arrays: tuple[np.ndarray, ...] = field(repr=False, default=())


def load_shared_weights(model: ModelFile, device: Device,
                        meter: MemoryMeter | None = None) -> SharedWeights:
    """Load every external initializer of `model` once, as host OrtValues all sessions share.

    The OrtValues wrap copy-on-write memory maps of the data files, faulted in here (so the
    pages are the runtime's, not the first variant's). They stay in host memory on every
    device: `SessionOptions.add_initializer` takes only buffers the caller owns, and an OrtValue
    that ONNX Runtime allocated on the GPU is refused ("Buffer containing the initializer must
    be owned by the user"). On CUDA each session therefore copies the initializers to the
    device when it is created: one device copy per per-width session (see docs/cuda.md), and
    the pages are not faulted in here (each session reads them as it copies, and the kernel
    may drop them after: they are clean file pages). `meter` is read around it
    (`resident_bytes`).
    """
    on_host = device.device_type == "cpu"
    if meter is None:
        loaded, grown = _load_values(model, device, on_host), None
    else:
        loaded, grown = measured(meter, lambda: _load_values(model, device, on_host))
    names, values, nbytes, arrays = loaded
    return SharedWeights(names, values, nbytes, resident_bytes=grown,
                         copied_per_session=not on_host, host_copy=on_host and bool(names),
                         arrays=arrays)


def _load_values(model: ModelFile, device: Device, resident: bool) -> tuple[
        tuple[str, ...], tuple[ort.OrtValue, ...], int, tuple[np.ndarray, ...]]:
    names: list[str] = []
    values: list[ort.OrtValue] = []
    arrays: list[np.ndarray] = []
    nbytes = 0
    for tensor, where in model.external_initializers():
        array = _map_external(tensor, where)
        if resident:
            fault_in(array)
        arrays.append(array)
        names.append(tensor.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(array))
        nbytes += array.nbytes
    logger.info("loaded %d external initializers (%d bytes) once in host memory for all "
                "sessions on %s", len(names), nbytes, device.label)
    return tuple(names), tuple(values), nbytes, tuple(arrays)


def owned_by_session(model: ModelFile) -> SharedWeights:
    """No shared weights: the one session loads `model`'s own; `nbytes` says their size."""
    # check_tensors refused every external tensor without a fixed width.
    nbytes = sum(tensor_nbytes(tensor.data_type, tensor.dims) or 0
                 for tensor, _ in model.external_initializers())
    return SharedWeights((), (), nbytes, shared=False)


def fault_in(array: np.ndarray) -> int:
    """Read one byte of every page of `array`, so that all of it is resident; their sum."""
    return int(array.reshape(-1).view(np.uint8)[::_PAGE_SIZE].sum(dtype=np.uint64))


def _map_external(tensor: TensorRef, where: ExternalData) -> np.ndarray:
    dtype = numpy_dtype(tensor.data_type)
    shape = tensor.dims
    count = int(np.prod(shape, dtype=np.int64))
    if where.length is not None and where.length != count * dtype.itemsize:
        raise ModelLoadError(
            f"external tensor {tensor.name!r} declares {where.length} bytes but its shape "
            f"{list(shape)} of {dtype} needs {count * dtype.itemsize}; export the model again")
    if count == 0:
        return np.zeros(shape, dtype)
    try:
        return np.memmap(where.path, dtype=dtype, mode="c", offset=where.offset, shape=shape)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot map external data of {tensor.name!r} from "
                             f"{str(where.path)!r}: {error}") from error


# ONNX Runtime's RUN option that shrinks the arenas after a run
# (include/onnxruntime/core/session/onnxruntime_run_options_config_keys.h,
# kOrtRunOptionsConfigEnableMemoryArenaShrinkage): it would free arena regions that a captured
# CUDA graph still writes to at its next replay. The runtime makes every run's options itself
# (`run_lock.run_options`) and never sets it; as a session option ONNX Runtime would ignore it.
ARENA_SHRINKAGE_KEY = "memory.enable_memory_arena_shrinkage"


def refuse_shrinkage(config: Mapping[str, str]) -> None:
    """ConfigError where the session options `config` ask for arena shrinkage: a run option,
    which a session's options cannot set, and which the runtime's runs never set."""
    if ARENA_SHRINKAGE_KEY in config:
        raise ConfigError(f"{ARENA_SHRINKAGE_KEY} is an ONNX Runtime run option, not a session "
                          "option, and the runtime's runs never shrink the arena (captured CUDA "
                          "graphs replay into it); drop it")


class SessionFactory:
    """Creates the sessions of one model on one device, all sharing `SharedWeights`.

    Rules:
    1. Every session gets every external initializer through `add_initializer`; without
       `weights` (a runtime of one session) each session loads its own from the data files.
    2. `fixed_dims` (batch, KV capacity, a capacity-wide mask) are overridden in every session;
       a session for a width also overrides `query_dim`; width None is shape-generic.
    3. Pre-packing is on only when `prepack` is asked for (the runtime asks for the decode
       session and for every session of a MatMulNBits model).
    4. `log_severity` and `session_config` apply to every session created from then on (the
       GPU check reads ONNX Runtime's capture log lines and node placement through them).
    5. `last_row` builds the session from the model with a chosen logits row (`logits_row`),
       made once per factory and handed to ONNX Runtime as bytes.
    6. `graph` (serialized bytes) replaces the file's graph in every session; bytes are handed
       to ONNX Runtime with the model's folder as the folder of its external data.
    7. `sessions_alive` and `weights_copies` count sessions created and not yet freed, and the
       copies of the weights they own (see the module docstring), from those events.
    """

    def __init__(self, model_path: Path, weights: SharedWeights, device: Device, *,
                 query_dim: str | None, fixed_dims: Mapping[str, int],
                 intra_op_threads: int | None = None, log_severity: int = 3,
                 session_config: Mapping[str, str] | None = None,
                 graph: bytes | None = None) -> None:
        self.model_path = model_path
        self.graph = graph
        self.weights = weights
        self.device = device
        self.query_dim = query_dim
        self.fixed_dims = dict(fixed_dims)
        self.intra_op_threads = intra_op_threads
        self.log_severity = log_severity
        self.session_config = dict(session_config or {})
        refuse_shrinkage(self.session_config)
        if device.device_type == "cuda":
            check_cuda_api()  # an older onnxruntime-gpu is refused here, at load
        self._lock = threading.Lock()
        self._row_model: bytes | None = None
        self.sessions_created = 0
        self.sessions_alive = 0
        self._owned_copies = 0

    @property
    def weights_copies(self) -> int:
        """Copies of the weights held now: the shared host copy, plus one per live session
        that owns one."""
        with self._lock:
            return self._owned_copies + int(self.weights.host_copy)

    def _owns_copy(self, prepack: bool) -> bool:
        weights = self.weights
        return not weights.shared or weights.copied_per_session or (prepack and bool(weights.names))

    def _freed(self, owns: bool) -> None:
        with self._lock:
            self.sessions_alive -= 1
            self._owned_copies -= int(owns)

    def create(self, width: int | None, *, prepack: bool, capture: bool = False,
               last_row: bool = False) -> ort.InferenceSession:
        """A session for query width `width` (None: shape-generic); `capture`: CUDA graphs;
        `last_row`: its logits are the one row its `logits_row` input picks."""
        if capture:
            try:
                return self._create(width, prepack, capture=True, last_row=last_row)
            except ModelLoadError as error:
                # The reason as text: a logged exception would keep its traceback's frames
                # (and the sessions they come to hold) alive in whatever keeps the record.
                logger.warning("width %s cannot capture a CUDA graph, running it without: %s",
                               width, str(error))
        return self._create(width, prepack, capture=False, last_row=last_row)

    def _model_source(self, last_row: bool) -> str | bytes:
        if not last_row:
            return str(self.model_path) if self.graph is None else self.graph
        with self._lock:
            if self._row_model is None:
                self._row_model = select_row(self.graph if self.graph is not None
                                             else self.model_path.read_bytes())
            return self._row_model

    def _create(self, width: int | None, prepack: bool, capture: bool,
                last_row: bool = False) -> ort.InferenceSession:
        options = ort.SessionOptions()
        if last_row or self.graph is not None:
            options.add_session_config_entry(EXTERNAL_DATA_FOLDER_KEY,
                                             str(self.model_path.resolve().parent))
        options.log_severity_level = self.log_severity
        for key, value in self.session_config.items():
            options.add_session_config_entry(key, value)
        if self.intra_op_threads is not None:
            options.intra_op_num_threads = self.intra_op_threads
        try:
            for name, value in zip(self.weights.names, self.weights.values):
                options.add_initializer(name, value)
        except Exception as error:  # ORT's own exception types
            raise ModelLoadError(f"ONNX Runtime refuses the shared weights for a session on "
                                 f"{self.device.label}: {error}") from error
        dims = dict(self.fixed_dims)
        if width is not None and self.query_dim is not None:
            dims[self.query_dim] = width
        for name, size in dims.items():
            options.add_free_dimension_override_by_name(name, size)
        if not prepack:
            options.add_session_config_entry(DISABLE_PREPACKING_KEY, "1")
        if width is None:
            # ORT plans a memory pattern per set of input shapes and keeps each one; a
            # shape-generic session sees a new mask width every step and a new query width per
            # remainder, so the patterns pile up. Off, its arena serves them all: on the bench
            # decoder a 4000-token prompt peaked at 641 MiB instead of 694, TTFT unchanged.
            options.enable_mem_pattern = False
        try:
            session = ort.InferenceSession(self._model_source(last_row), options,
                                           providers=self.device.providers(capture))
        except Exception as error:  # ORT raises its own exception types, one per failure
            raise ModelLoadError(
                f"ONNX Runtime cannot create a session for {str(self.model_path)!r} on "
                f"{self.device.label} (width {width if width is not None else 'dynamic'}): "
                f"{error}") from error
        used = session.get_providers()[0]
        expected = self.device.session_providers[0][0]
        if used != expected:
            raise ProviderError(f"a session asked for {expected} came up on {used}; the device "
                                f"{self.device.label} is not usable, choose another provider")
        owns = self._owns_copy(prepack)
        with self._lock:
            self.sessions_created += 1
            self.sessions_alive += 1
            self._owned_copies += int(owns)
        weakref.finalize(session, self._freed, owns)
        logger.debug("created session width=%s prepack=%s capture=%s last_row=%s dims=%s",
                     width, prepack, capture, last_row, dims)
        return session
