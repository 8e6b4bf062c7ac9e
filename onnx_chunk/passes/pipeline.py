"""The decoder passes as one onnx_ir `Sequential`, and the checks of the whole pipeline."""

from __future__ import annotations

import onnx_ir as ir

from onnx_chunk.errors import OnnxChunkError
from onnx_chunk.passes.chunked_prefill_declaration import ChunkedPrefillDeclarationPass
from onnx_chunk.passes.concat_kv_layers import grows_kv_by_concat
from onnx_chunk.passes.kv_capacity import KVCapacityPass
from onnx_chunk.passes.logits_rows import LogitsRowsPass
from onnx_chunk.passes.per_token_ports import PerTokenPortsPass
from onnx_chunk.passes.preconditions import ModelPreconditionError, precondition
from onnx_chunk.passes.query_seqlens import QuerySeqlensPass
from onnx_chunk.passes.recurrent_state import RecurrentStatePass
from onnx_chunk.passes.supported_opsets import check_supported_opsets
from onnx_chunk.passes.value_tracing import gqa_nodes, tensor_scatter_nodes


class DecoderPipeline(ir.passes.Sequential):
    """onnx_ir's `Sequential` over decoder passes, refusing first what none of them could convert.

    Rules:
    1. Before any pass runs, every opset and operator domain must be one ONNX Runtime runs
       (`check_supported_opsets`), else ModelStructureError.
    2. With `require_kv_cache` (what `convert_model` asks): the model must keep a KV cache the
       passes bind at capacity, a GroupQueryAttention or TensorScatter node or a KV grown by
       Concat (which the concat-KV rewrite turns into one, or refuses), else
       ModelStructureError.
    3. `Sequential` then runs the passes in order, each after its own `requires()`; the next
       pass gets the model a pass returns (the concat-KV rewrite's copy), and `modified` is
       whether any pass changed something.
    4. A typed error of onnx_chunk.errors that a pass raises reaches the caller as it is, not
       wrapped in onnx_ir's PassError.
    """

    def __init__(self, *passes: ir.passes.PassBase, require_kv_cache: bool = False) -> None:
        super().__init__(*passes)
        self.require_kv_cache = require_kv_cache

    def requires(self, model: ir.Model) -> None:
        with precondition():
            check_supported_opsets(model)
        graph = model.graph
        if self.require_kv_cache and not (gqa_nodes(graph) or tensor_scatter_nodes(graph)
                                          or grows_kv_by_concat(graph)):
            raise ModelPreconditionError(
                "the model has no com.microsoft::GroupQueryAttention node, so KV capacity "
                "annotation does not apply; the runtime can still run it with whole-prompt "
                "prefill and a growing KV cache, without chunked-prefill padding or capacity "
                "binding")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        try:
            return super().call(model)
        except ir.passes.PassError as error:
            if isinstance(error.__cause__, OnnxChunkError):
                raise error.__cause__ from None
            raise


def annotation_passes(chunk_size: int | None, max_variants: int,
                      native_chunks: str | None = None,
                      logits_rows: str | None = None) -> list[ir.passes.PassBase]:
    """The passes that find and declare the chunked-prefill plan, in the order they need.

    The per-token ports pass reads the recurrent state findings and the query_seqlens and
    logits_rows inputs (no per-token ports), and the declaration reads all of them; each checks
    in `requires()` that its inputs are in the metadata. `native_chunks` (`logits_rows`) None
    keeps the graph's query_seqlens (logits rows) wiring and its metadata as they are.
    """
    wiring: list[ir.passes.PassBase] = []
    if native_chunks is not None:
        wiring.append(QuerySeqlensPass(native_chunks))
    if logits_rows is not None:
        wiring.append(LogitsRowsPass(logits_rows))
    return [KVCapacityPass(), RecurrentStatePass(), *wiring, PerTokenPortsPass(),
            ChunkedPrefillDeclarationPass(chunk_size=chunk_size, max_variants=max_variants)]
