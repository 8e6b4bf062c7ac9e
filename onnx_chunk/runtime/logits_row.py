"""A session that returns one logits row, picked by an input: what a captured width outputs.

A CUDA graph replays fixed addresses, so a width that captures keeps its output buffers bound
for good, per sequence: [1, W, vocab] logits for a prefill width (16 MiB at W = 256 and a 32k
vocabulary in float16, per sequence and per width), though a prefill needs one row at most,
the last real one (padded rows repeat the last token, so its index moves with the padding).
The session built for such a width takes the row to return as an input, written in place
before each forward like the tokens, so the bound logits are [1, 1, vocab]; the full logits
become an intermediate of the session's own arena, shared by every sequence. When a caller
asks for every row, the same session runs with the full output bound instead (`ALL_ROWS`).

Rules of `select_row`:
1. A graph input `logits_row` ([1] int64) is added and `logits` becomes `Gather(rows,
   logits_row, axis=1)`: [batch, 1, vocab].
2. The full logits stay a graph output, renamed `logits_all`, for the callers that need every
   row.
3. A model whose logits keep one row already (a fixed 1 on the row axis) gets nothing: it is
   refused, since its only row is the last query row, not a chosen one.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_chunk.errors import ModelStructureError
from onnx_chunk.runtime.ports import LOGITS_OUTPUT

ROW_INPUT = "logits_row"
ALL_ROWS = "logits_all"


def select_row(model: ir.Model) -> ir.Model:
    """`model` (changed in place) whose `logits` output is the row `logits_row` picks."""
    graph = model.graph
    logits = next((value for value in graph.outputs if value.name == LOGITS_OUTPUT), None)
    if logits is None:
        raise ModelStructureError(f"the decoder has no {LOGITS_OUTPUT!r} output to pick a row of")
    if logits.shape is None or len(logits.shape) != 3 or logits.shape[1] == 1:
        raise ModelStructureError(
            f"expected logits shaped [batch, rows, vocab] with a row per query row, got "
            f"{None if logits.shape is None else list(logits.shape)}; a decoder that returns "
            "one row already needs no row selection")
    row = ir.Value(name=ROW_INPUT, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(row)
    logits.name = ALL_ROWS
    picked = ir.Value(name=LOGITS_OUTPUT, shape=ir.Shape([logits.shape[0], 1, logits.shape[2]]),
                      type=logits.type)
    graph.append(ir.node("Gather", [logits, row], attributes={"axis": 1}, outputs=[picked]))
    graph.outputs.insert(graph.outputs.index(logits), picked)
    return model
