"""An edit of a serialized decoder's graph at load, for the sessions made from it.

The runtime edits a decoder's graph without onnx or onnx_ir (`onnx_wire`): a session that
returns one chosen logits row (`logits_row`), a graph without native chunks for an ONNX Runtime
that lacks them (`without_query_seqlens`). `edit_decoder` splices the new graph into the model:
every other field keeps its bytes, as views of the model's bytes until the one join, so weights
stored inside the .onnx are copied once.
"""

from __future__ import annotations

from collections.abc import Callable

from onnx_chunk.errors import ModelLoadError, ModelStructureError
from onnx_chunk.graph.onnx_wire import (
    LEN,
    Span,
    WireError,
    as_span,
    field_pieces,
    fields,
    len_header,
)

# ModelProto's graph field.
_MODEL_GRAPH = 7


def edit_decoder(data: bytes, graph: Callable[[memoryview, Span], list],
                 drop: Callable[[int, int | Span], bool] = lambda number, value: False) -> bytes:
    """The serialized decoder `data` with its graph's payload the pieces `graph(view, span)`
    gives for it, and its fields `drop(number, value)` names left out. ModelLoadError when the
    bytes are no protobuf, ModelStructureError unless the model has exactly one graph."""
    try:
        return _edited(data, graph, drop)
    except WireError as error:
        raise ModelLoadError(f"the decoder's protobuf cannot be read ({error}); export it "
                             "again") from error


def _edited(data: bytes, graph: Callable[[memoryview, Span], list],
            drop: Callable[[int, int | Span], bool]) -> bytes:
    view = memoryview(data)
    pieces: list = []
    graphs = 0
    for number, wire, value in fields(data, 0, len(data)):
        if number == _MODEL_GRAPH and wire == LEN:
            graphs += 1
            edited = graph(view, as_span(value))
            pieces.append(len_header(_MODEL_GRAPH, sum(len(piece) for piece in edited)))
            pieces += edited
        elif not drop(number, value):
            pieces += field_pieces(view, number, wire, value)
    if graphs != 1:
        raise ModelStructureError(f"expected one graph in the decoder, found {graphs}")
    return b"".join(pieces)
