"""The graphs of a static decoder and the one forward each runs: `GraphRunner`.

Two graph contracts are served, told apart once per graph by its mask (`CacheLayout`): the
static reference decoder's (additive float mask [1, 1, c, C], position_ids, present holding only
the forward's new K/V, rolled into a right-aligned cache that may slide) and GroupQueryAttention
bound at capacity, as `fix-shapes` writes it (integer mask [1, C], present the whole buffer
written in place, prompts padded on the right, no sliding). A window-sized cache
(GroupQueryAttention `sliding_window_cache=1`) in the bound layout holds C positions and evicts
only past C, which the bound layout never reaches; ONNX Runtime's CUDA kernel takes such a cache
only at capacity == window (`Device.window_slack`), so other capacities are refused there.

Every forward runs through one IOBinding per graph on the runner's device (`Device.run`),
bound anew for each forward and cleared after it: the KV cache lives
in device buffers allocated once per request and never crosses to the host (the bound layout
is written in place by the attention, the rolling one is rolled by device-to-device copies);
the host sends the token ids, positions and mask, and reads back one row of logits when a token
is chosen.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnx_chunk.errors import (
    InputError,
    ModelLoadError,
    ModelStructureError,
)
from onnx_chunk.runtime.device.buffers import DeviceBuffer, device_zeros
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.runner.forward import Forward, Ran
from onnx_chunk.runtime.stats import kv_dtype_name
from onnx_chunk.static.alignment import (
    PadSide,
    pad_rows,
)
from onnx_chunk.static.bound_kv import BoundKVCache
from onnx_chunk.static.kv_buffers import PAST, PRESENT, StaticKVBuffers
from onnx_chunk.static.rolling_kv import RollingKVCache

_PAST_NAME = re.compile(r"^past_key_values\.\d+\.(key|value)$")
FED_INPUTS = ("input_ids", "position_ids", "attention_mask")
"""The inputs besides past_key_values.N.key|value that the runner feeds."""
METADATA_PREFIX = "onnx_chunk.static."
"""The prefix of the metadata keys a static reference decoder declares its sizes under."""


@dataclass
class StaticLength:
    """A static request's length: the real positions fed so far, so the next position id.
    Padding is not counted (`Length`, as the dynamic runtime's sequences have)."""

    capacity: int
    length: int = 0

    @property
    def room(self) -> int:
        """Positions left before C (past it a rolling cache slides; a bound one is refused
        up front, `StaticRunner.check_request`)."""
        return max(0, self.capacity - self.length)

    def end(self, width: int) -> int:
        """Where a forward of `width` real rows at this length ends."""
        return self.length + width

    def advance(self, rows: int) -> None:
        self.length += rows

    def rewind(self, count: int) -> None:
        """Nothing to rewind: a static cache keeps every row it took (a rolling one has moved
        its rows), so only a rewind of 0 is possible; InputError otherwise."""
        if count:
            raise InputError(f"a static request cannot rewind {count} positions: its cache "
                             "keeps every row it took")


@dataclass
class StaticSlot:
    """What a static request's forwards run on: its KV cache, which positions of its sequence
    so far (padding included) are real, and its length."""

    cache: StaticKVBuffers
    length: StaticLength
    valid: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


class CacheLayout(Enum):
    """How a static graph takes its KV cache and its mask."""

    ROLLING = "rolling"
    """Additive float mask [1, 1, c, C] and position_ids; present is the forward's new K/V,
    rolled into a right-aligned cache (`RollingKVCache`), which slides past C."""
    BOUND = "bound"
    """GroupQueryAttention bound at capacity: integer mask [1, C] of ones on the written
    positions, present the whole buffer written in place (`BoundKVCache`); never slides."""

    @property
    def pad_side(self) -> PadSide:
        return PadSide.LEFT if self is CacheLayout.ROLLING else PadSide.RIGHT

    @property
    def cache_type(self) -> type[StaticKVBuffers]:
        return RollingKVCache if self is CacheLayout.ROLLING else BoundKVCache


@dataclass(frozen=True)
class GraphSpec:
    rows: int
    capacity: int
    num_layers: int
    kv_heads: int
    head_width: int
    """The KV inputs' last axis as stored: the head size, or half of it (rounded up) for a
    packed int4 cache."""
    mask_dtype: np.dtype
    kv_dtype: np.dtype
    layout: CacheLayout
    position_ids: bool
    """Whether the graph takes position_ids (the rolling layout always does)."""
    logits: str
    """The logits output's name (the graph's first output)."""
    logits_dtype: np.dtype

    @property
    def kv_dtype_name(self) -> str:
        """The cache type as `RuntimeStats.kv_dtype` names it: float32, float16, int8, int4."""
        return kv_dtype_name([self.kv_dtype])

    @property
    def kv_bytes(self) -> int:
        """One request's KV cache at the capacity, every layer's K and V, in bytes."""
        return (2 * self.num_layers * self.kv_heads * self.capacity * self.head_width
                * self.kv_dtype.itemsize)


def open_session(path: Path, device: Device) -> ort.InferenceSession:
    if path.is_dir():
        raise ModelLoadError(f"static decoder {path} is a folder; pass the graph's .onnx file")
    if not path.is_file():
        raise ModelLoadError(f"static decoder {path} does not exist; build it or fix the path")
    try:
        return ort.InferenceSession(os.fspath(path), providers=list(device.session_providers))
    except Exception as error:  # ORT raises its own untyped exceptions
        raise ModelLoadError(
            f"ONNX Runtime cannot load {path}: {error}; check the file and its external data"
        ) from error


def graph_spec(session: ort.InferenceSession, path: Path) -> GraphSpec:
    inputs = {port.name: port for port in session.get_inputs()}
    unknown = sorted(name for name in inputs
                     if name not in FED_INPUTS and not _PAST_NAME.match(name))
    if unknown:
        raise ModelStructureError(
            f"{path} takes input(s) {', '.join(unknown)} that the static runner cannot feed; "
            f"it feeds {', '.join(FED_INPUTS)} and past_key_values.N.key|value (no recurrent "
            f"or conv state, no other ports); run the dynamic model instead"
        )
    missing = [name for name in ("input_ids", "attention_mask") if name not in inputs]
    found_kv = {name for name in inputs if _PAST_NAME.match(name)}
    num_layers = len(found_kv) // 2
    expected_kv = {PAST.format(layer, kind) for layer in range(num_layers)
                   for kind in ("key", "value")}
    if missing or not found_kv or found_kv != expected_kv:
        raise ModelStructureError(
            f"{path} takes {', '.join(sorted(inputs))}; a static decoder takes input_ids, "
            f"attention_mask ([1, 1, c, C] additive, or [1, C] for GroupQueryAttention bound "
            f"at capacity) and past_key_values.N.key|value for every layer N = 0, 1, ... (build "
            f"a pair with build-model --variant static or fix-shapes)"
        )
    shapes = {name: port.shape for name, port in inputs.items()}
    free = sorted(name for name, shape in shapes.items()
                  if not all(isinstance(dim, int) for dim in shape))
    if free:
        raise ModelStructureError(
            f"{path} has free dimensions on {', '.join(free)}; a static decoder has every "
            f"dimension fixed"
        )
    past_shape = shapes[PAST.format(0, "key")]
    if len(past_shape) != 4 or len(shapes["input_ids"]) != 2:
        raise ModelStructureError(
            f"{path}: input_ids is {shapes['input_ids']} and past_key_values.0.key is "
            f"{past_shape}; expected [1, c] and [1, kv_heads, C, head_size]"
        )
    _, kv_heads, capacity, head_width = past_shape
    rows = shapes["input_ids"][1]
    layout = (CacheLayout.BOUND if len(shapes["attention_mask"]) == 2
              else CacheLayout.ROLLING)
    if layout is CacheLayout.ROLLING:
        expected_mask, present_len = [1, 1, rows, capacity], rows
        if "position_ids" not in inputs:
            raise ModelStructureError(
                f"{path} takes an additive attention_mask but no position_ids; the static "
                f"reference contract needs both (build one with build_static_decoder)"
            )
    else:
        expected_mask, present_len = [1, capacity], capacity
    if shapes["attention_mask"] != expected_mask:
        raise ModelStructureError(
            f"{path}: attention_mask has shape {shapes['attention_mask']}, expected "
            f"{expected_mask} (the {layout.value} layout for {rows} rows and capacity {capacity})"
        )
    outputs = {port.name: port.shape for port in session.get_outputs()}
    expected_present = [1, kv_heads, present_len, head_width]
    wrong = [f"{name} is {outputs.get(name)}" for layer in range(num_layers)
             for name in (PRESENT.format(layer, "key"), PRESENT.format(layer, "value"))
             if outputs.get(name) != expected_present]
    if wrong:
        raise ModelStructureError(
            f"{path}: {'; '.join(wrong[:2])}; expected {expected_present} ("
            + ("the forward's new K/V" if layout is CacheLayout.ROLLING
               else "the whole buffer, GroupQueryAttention bound at capacity") + ")"
        )
    logits = session.get_outputs()[0]
    return GraphSpec(rows, capacity, num_layers, kv_heads, head_width,
                      _numpy_dtype(inputs["attention_mask"], _MASK_DTYPES),
                      _kv_dtype(inputs, num_layers, layout, path),
                      layout, "position_ids" in inputs, logits.name,
                      _numpy_dtype(logits, _LOGITS_DTYPES))


_MASK_DTYPES: dict[str, type] = {"tensor(float16)": np.float16, "tensor(float)": np.float32,
                                 "tensor(int64)": np.int64, "tensor(int32)": np.int32}
_LOGITS_DTYPES: dict[str, type] = {"tensor(float16)": np.float16, "tensor(float)": np.float32}
# A float cache, or GroupQueryAttention's quantized one (`convert --kv-dtype`): int8, or uint8
# holding two 4-bit values a byte along the head axis (the runtime names it int4).
_KV_DTYPES: dict[str, type] = {"tensor(float16)": np.float16, "tensor(float)": np.float32,
                               "tensor(int8)": np.int8, "tensor(uint8)": np.uint8}


def _numpy_dtype(port: ort.NodeArg, allowed: dict[str, type]) -> np.dtype:
    if port.type not in allowed:
        raise ModelStructureError(
            f"the static decoder's {port.name} has type {port.type}; expected one of "
            f"{', '.join(allowed)}")
    return np.dtype(allowed[port.type])


def _kv_dtype(inputs: dict[str, ort.NodeArg], num_layers: int, layout: CacheLayout,
              path: Path) -> np.dtype:
    """The one element type of every past_key_values input. A quantized cache is served in
    the bound layout only: GroupQueryAttention, the one kernel that reads such a cache, writes
    its quantized rows in place there; no graph of the rolling layout (the static reference
    decoder's) reads one, so such a graph is refused rather than run untested."""
    ports = [inputs[PAST.format(layer, kind)] for layer in range(num_layers)
             for kind in ("key", "value")]
    types = sorted({port.type for port in ports})
    if len(types) > 1:
        raise ModelStructureError(
            f"{path}: the past_key_values inputs have types {', '.join(types)}; the static "
            f"runner keeps one cache type for every layer")
    dtype = _numpy_dtype(ports[0], _KV_DTYPES)
    if dtype.kind in "iu" and layout is CacheLayout.ROLLING:
        raise ModelStructureError(
            f"{path} keeps a {kv_dtype_name([dtype])} KV cache in the rolling layout "
            f"(additive mask [1, 1, c, C]); only GroupQueryAttention reads a quantized cache, "
            f"bound at capacity: run `fix-shapes` on a `convert --kv-dtype` model made with "
            f"--native-chunks off --logits-rows off")
    return dtype


def window_capacity_problem(windows: set[int], capacity: int, device: Device) -> str | None:
    """Why `device` cannot run window-sized caches of `windows` at `capacity`, else None: no
    kernel takes a cache shorter than its window, and CUDA's none larger either
    (`Device.window_slack` False)."""
    shorter = sorted(window for window in windows if window > capacity)
    if shorter:
        return (f"the graph keeps window-sized KV caches (window {', '.join(map(str, shorter))}) "
                f"at the capacity C={capacity}, and a window-sized cache cannot be shorter than "
                f"its window: fix the shapes with --capacity {shorter[-1]} or more")
    wider = sorted(window for window in windows if window != capacity)
    if device.window_slack or not wider:
        return None
    return (f"the graph keeps window-sized KV caches (window {', '.join(map(str, wider))}) at "
            f"the capacity C={capacity}, and ONNX Runtime's {device.provider} kernel takes such "
            f"a cache only at capacity == window; run it with --provider cpu, fix the shapes "
            f"with --capacity {wider[0]}, or run the dynamic model")


def metadata_int(session: ort.InferenceSession, key: str) -> int | None:
    value = session.get_modelmeta().custom_metadata_map.get(METADATA_PREFIX + key)
    return None if value is None else int(value)


class GraphRunner:
    """One static graph as a forward runner (`ForwardRunner[StaticSlot]`): a forward of up to
    `spec.rows` real rows of one request, widened to the graph's rows on the layout's side
    (`pad_rows`, as `align_prompt` pads a prompt) and run through the graph's one IOBinding.

    Rules:
    1. A forward is one stepping row of 1 to `spec.rows` tokens; its logits are "last" (the
       last real row, [1, vocab]) or "none" (ValueError otherwise).
    2. The rows go in at the slot's length; the slot's cache takes them (rolled, or written
       in place), its valid positions grow by the graph's rows and its length by the real ones.
    3. `Ran.padded_rows` is the rows added; `Ran.width` the graph's rows.
    """

    def __init__(self, session: ort.InferenceSession, spec: GraphSpec, device: Device, *,
                 pad_id: int, vocab_size: int) -> None:
        self.session = session
        self.spec = spec
        self.device = device
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self._binding = session.io_binding()
        # The device buffers of the graph's inputs (`_bind_input`), by input name.
        self._inputs: dict[str, DeviceBuffer] = {}

    def run(self, slot: StaticSlot, forward: Forward) -> Ran:
        """Run `forward` on `slot` (see the class docstring)."""
        rows = self.spec.rows
        if len(forward.rows) != 1 or not forward.rows[0].steps:
            raise ValueError(f"a static graph runs one stepping row per forward, got "
                             f"{len(forward.rows)}")
        if forward.logits == "all":
            raise ValueError('a static graph returns its last real row ("last") or none '
                             '("none"), not every row')
        row = forward.rows[0]
        if not 1 <= len(row.tokens) <= rows:
            raise ValueError(f"a forward of the {rows}-row graph feeds 1 to {rows} real rows, "
                             f"got {len(row.tokens)}")
        padded = pad_rows(row.tokens, row.length.length, rows, self.spec.layout.pad_side,
                          self.pad_id)
        start = len(slot.valid)
        valid = np.concatenate([slot.valid, padded.valid])
        last = int(np.flatnonzero(padded.valid)[-1]) if forward.logits == "last" else None
        logits = self._forward(slot.cache, valid, padded.input_ids, padded.position_ids,
                               start, last)
        slot.valid = valid
        row.length.advance(len(row.tokens))
        return Ran(None if logits is None else logits[None], rows, padded.pad_count)

    def _forward(self, cache: StaticKVBuffers, valid: np.ndarray, input_ids: np.ndarray,
                 position_ids: np.ndarray, start: int, logits_row: int | None) -> np.ndarray | None:
        """One forward of `spec.rows` positions starting at sequence index `start`, bound on the
        device through the graph's one IOBinding; updates the cache there (rolled, or written
        in place) and returns row `logits_row` of the logits ([vocab], a host copy of that row
        only), or None."""
        spec, binding = self.spec, self._binding
        try:
            # Inputs live in device buffers allocated once per input and written in place:
            # what crosses is the forward's ids, mask and positions, counted.
            self._bind_input("input_ids", np.ascontiguousarray(input_ids[None]))
            self._bind_input("attention_mask",
                             cache.forward_mask(valid, start, spec.rows, spec.mask_dtype))
            if spec.position_ids:
                self._bind_input("position_ids", np.ascontiguousarray(position_ids[None]))
            # Bound first, so that it is the binding's first output (outputs come in bind
            # order); bound to the device only, so ONNX Runtime allocates it for this run.
            binding.bind_output(spec.logits, self.device.device_type, self.device.device_id)
            cache.bind(binding, spec.rows)
            self.device.run(self.session, binding, None)
            if not self.device.host_visible:
                binding.synchronize_outputs()
            cache.after_forward(valid[start:start + spec.rows])
            if logits_row is None:
                return None
            logits = DeviceBuffer(binding.get_outputs()[0], None, spec.logits_dtype,
                                  None if self.device.host_visible else self.device.transfers)
            return np.array(logits.read(logits_row * self.vocab_size, self.vocab_size))
        finally:
            # Emptied after every forward, so that the binding holds no buffer of this request
            # (its cache, the logits ONNX Runtime allocated) once it ends, and the next forward
            # binds every name afresh, the logits first.
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()

    def _bind_input(self, name: str, array: np.ndarray) -> None:
        """Write `array` into the device buffer of input `name` (allocated on first use) and
        bind it."""
        buffer = self._inputs.get(name)
        if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
            buffer = self._inputs[name] = device_zeros(array.shape, array.dtype, self.device)
        buffer.write(array)
        self._binding.bind_ortvalue_input(name, buffer.value)
