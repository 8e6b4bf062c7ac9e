"""The decoder's ports as the runtime binds them: names, concrete shapes and dtypes.

Derived once per model from the graph's inputs and outputs as the file declares them
(`model_file`, read without onnx) and the chunked-prefill plan.
Symbolic batch dimensions become 1, the capacity axis of every KV input becomes the capacity
(a window-sized cache: its window plus the slack the device asks for, at most the capacity);
the head axes take the sizes the plan resolved from the graph (builder exports declare the
head size symbolic, `kv_cache_dim`), else genai_config.json's `head_size`; any other free
dimension of a KV or state buffer is an error naming it, since the buffer is allocated once
before any forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.graph.chunk_plan import ChunkPlan
from onnx_chunk.graph.data_types import numpy_dtype
from onnx_chunk.graph.logits_row import LOGITS_OUTPUT
from onnx_chunk.graph.model_file import ModelFile, ValueInfo

MASK_INPUT = "attention_mask"
_KV_HEADS_AXIS = 1
_HEAD_SIZE_AXIS = 3


@dataclass(frozen=True)
class BufferPort:
    """A graph input carried to the next forward through a paired output.

    `window` is set on a window-sized KV cache (the attention evicts as it fills).
    """

    input: str
    output: str
    shape: tuple[int, ...]
    dtype: np.dtype
    window: int | None = None


@dataclass(frozen=True)
class ModelPorts:
    """Everything the runtime binds, resolved for one capacity."""

    token_input: str
    token_dtype: np.dtype
    hidden_size: int | None
    position_ids: str | None
    mask_dtype: np.dtype
    mask_dim: str | None
    vocab_size: int
    logits_dtype: np.dtype
    last_row_logits: bool
    kv: tuple[BufferPort, ...]
    state: tuple[BufferPort, ...]
    batch_dim: str | None
    query_dim: str | None
    fixed_dims: dict[str, int]
    # The graph input feeding GroupQueryAttention's query_seqlens (native chunks), or None.
    query_seqlens: str | None = None
    # The graph input choosing the query rows whose logits the graph computes (int64 row
    # indices, `convert --logits-rows`), or None: every row's logits.
    logits_rows: str | None = None


def model_ports(model: ModelFile, plan: ChunkPlan, capacity: int, *,
                head_size: int | None = None, window_slack: int = 0) -> ModelPorts:
    """Resolve the ports of `model` for `capacity`; ModelStructureError when one cannot be.

    `head_size` (genai_config.json's) sizes a head axis the graph leaves free; a window-sized
    cache gets `window + window_slack` positions, at most `capacity`.
    """
    inputs = {value.name: value for value in model.inputs}
    outputs = {value.name: value for value in model.outputs}
    token = _required(inputs, plan.token_input, "token input")
    mask = _required(inputs, MASK_INPUT, "attention mask input")
    logits = _required(outputs, LOGITS_OUTPUT, "logits output")
    batch_dim = _param(token, 0)
    query_dim = _param(token, 1)
    vocab = _int_dim(logits, -1, "vocabulary")
    hidden = _int_dim(token, -1, "hidden") if plan.token_input == "inputs_embeds" else None
    fixed_dims = {} if batch_dim is None else {batch_dim: 1}
    kv = []
    named_sizes: dict[str, set[int]] = {}
    for binding in plan.capacity_inputs:
        value = _required(inputs, binding.input, "KV input")
        if binding.output not in outputs:
            raise ModelStructureError(
                f"KV input {binding.input!r} has no paired present output in the graph (plan "
                f"says {binding.output!r}); re-run `onnx-chunk convert` on the exported model")
        positions = (capacity if binding.window is None
                     else min(capacity, binding.window + window_slack))
        sizes = {binding.capacity_axis: positions}
        for axis, size in ((_KV_HEADS_AXIS, binding.kv_heads),
                           (_HEAD_SIZE_AXIS, binding.head_size or head_size)):
            if size is not None:
                sizes[axis] = size
        shape = _buffer_shape(value, batch_dim, sizes)
        for axis, size in sizes.items():
            name = _param(value, axis)
            if name is not None:
                named_sizes.setdefault(name, set()).add(size)
        kv.append(BufferPort(binding.input, binding.output, shape, _dtype(value),
                             binding.window))
    # A name that sizes one axis differently in two layers (gemma3's local and global head
    # sizes share `kv_cache_dim`) is left free; the bound buffers fix each layer's shape.
    fixed_dims.update({name: sizes.pop() for name, sizes in named_sizes.items()
                       if len(sizes) == 1})
    state = []
    for binding in plan.recurrent_state:
        value = _required(inputs, binding.input, "state input")
        if not binding.output or binding.output not in outputs:
            raise ModelStructureError(
                f"state input {binding.input!r} has no paired output in the graph, so its state "
                "cannot be carried from step to step; the model is not a runnable decoder")
        state.append(BufferPort(binding.input, binding.output, _buffer_shape(value, batch_dim, {}),
                                _dtype(value)))
    known = {plan.token_input, MASK_INPUT, *(port.input for port in kv),
             *(port.input for port in state)}
    if plan.position_ids is not None:
        _required(inputs, plan.position_ids, "position_ids input")
        known.add(plan.position_ids)
    if plan.query_seqlens is not None:
        _required(inputs, plan.query_seqlens, "query_seqlens input (the plan names it)")
        known.add(plan.query_seqlens)
    if plan.logits_rows is not None:
        _required(inputs, plan.logits_rows, "logits_rows input (the plan names it)")
        known.add(plan.logits_rows)
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ModelStructureError(
            f"the runtime does not know how to feed input(s) {', '.join(map(repr, unknown))}; "
            f"it feeds the token input, {MASK_INPUT!r}, position ids, KV and recurrent state "
            "inputs only: export the decoder without extra request inputs")
    return ModelPorts(
        token_input=plan.token_input,
        token_dtype=_dtype(token),
        hidden_size=hidden,
        position_ids=plan.position_ids,
        mask_dtype=_dtype(mask),
        mask_dim=_param(mask, 1),
        vocab_size=vocab,
        logits_dtype=_dtype(logits),
        last_row_logits=_last_row_only(logits),
        kv=tuple(kv),
        state=tuple(state),
        batch_dim=batch_dim,
        query_dim=query_dim,
        fixed_dims=fixed_dims,
        query_seqlens=plan.query_seqlens,
        logits_rows=plan.logits_rows,
    )


def _last_row_only(logits: ValueInfo) -> bool:
    """Whether the logits output keeps one row whatever the query width (a fixed 1)."""
    return logits.shape is not None and len(logits.shape) == 3 and logits.shape[1] == 1


def _required(values: dict[str, ValueInfo], name: str, what: str) -> ValueInfo:
    if name not in values:
        raise ModelStructureError(f"the decoder has no {what} named {name!r}; found "
                                  f"{', '.join(sorted(values))}")
    return values[name]


def _shape_text(shape: tuple[int | str | None, ...] | None) -> str:
    if shape is None:
        return "None"
    return "[" + ",".join("?" if dim is None else str(dim) for dim in shape) + "]"


def _param(value: ValueInfo, axis: int) -> str | None:
    if value.shape is None or len(value.shape) <= axis:
        return None
    dim = value.shape[axis]
    return dim if isinstance(dim, str) else None


def _int_dim(value: ValueInfo, axis: int, what: str) -> int:
    if value.shape is None or not isinstance(value.shape[axis], int):
        raise ModelStructureError(f"{value.name!r} has no fixed {what} size (shape "
                                  f"{_shape_text(value.shape)}); the runtime needs it to "
                                  "allocate buffers")
    return value.shape[axis]


def _dtype(value: ValueInfo) -> np.dtype:
    if value.elem_type is None:
        raise ModelStructureError(f"{value.name!r} declares no element type")
    try:
        return numpy_dtype(value.elem_type)
    except ValueError as error:
        raise ModelStructureError(f"{value.name!r} has an element type the runtime does not "
                                  f"know ({error}); export the decoder again") from error


def _buffer_shape(value: ValueInfo, batch_dim: str | None,
                  sizes: dict[int, int]) -> tuple[int, ...]:
    if value.shape is None:
        raise ModelStructureError(f"{value.name!r} declares no shape; the runtime allocates its "
                                  "buffer once and needs every size")
    shape = []
    for axis, dim in enumerate(value.shape):
        if axis in sizes:
            shape.append(sizes[axis])
        elif isinstance(dim, int):
            shape.append(dim)
        elif axis == 0 or (batch_dim is not None and dim == batch_dim):
            shape.append(1)
        else:
            raise ModelStructureError(
                f"{value.name!r} has a free dimension {dim!r} at axis {axis} (shape "
                f"{_shape_text(value.shape)}) that nothing in the graph sizes, and no "
                "genai_config.json head_size does; its buffer is allocated once before any "
                "forward: give the axis a size in the export, or a head_size in "
                "genai_config.json")
    return tuple(shape)
