"""What a runtime reads of its decoder before it builds anything: the file as it will run, the
chunked-prefill plan (declared, or found by the passes in memory) and an inputs_embeds
decoder's embedding table."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from onnx_chunk.analysis_cache import cached_plan
from onnx_chunk.errors import ModelLoadError
from onnx_chunk.graph.chunk_plan import ChunkPlan
from onnx_chunk.graph.metadata import read_plan
from onnx_chunk.graph.model_file import ModelFile, read_model_file
from onnx_chunk.graph.query_seqlens import lacking_reason, query_seqlens_index
from onnx_chunk.graph.without_query_seqlens import without_query_seqlens
from onnx_chunk.runtime.device.native_trust import native_refusal
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.state.ports import ModelPorts

logger = logging.getLogger(__name__)

EMBEDDINGS_FILE = "embeddings.npy"


def runnable_decoder(model_path: Path, graph: bytes | None, device: Device, *,
                     exact: bool) -> tuple[ModelFile, ChunkPlan | None, bytes | None]:
    """The decoder file as it will run on `device`, the plan it declares (None: never
    converted) and the graph to run in place of the file's (None: the file's own; `graph`:
    the caller's edited copy).

    A decoder converted where ONNX Runtime has native chunks runs without them (the "repeat"
    path, onnx_chunk/graph/without_query_seqlens.py) when this ONNX Runtime lacks them, their
    kernel is not verified on this device (device/native_trust.py), or exact mode pads a prompt
    forward with rows that must be computed as real ones (a native forward computes its real
    rows alone).
    """
    model = read_model_file(model_path, graph)
    plan = read_plan(model.metadata)
    refused = (None if plan is None or plan.query_seqlens is None
               else "exact mode computes padded rows as real ones" if exact
               else lacking_reason() if query_seqlens_index() is None
               else native_refusal(device))
    if refused is None:
        return model, plan, graph
    logger.info("%s was converted for native chunks, and %s: running it without them",
                model_path.name, refused)
    graph = without_query_seqlens(graph if graph is not None else model_path.read_bytes())
    model = read_model_file(model_path, graph)
    return model, read_plan(model.metadata), graph


def analyzed_plan(model_path: Path, chunk_size: int | None, data_files: set[Path]) -> ChunkPlan:
    """The plan `onnx-chunk convert` would write for an unconverted model: the passes run in
    memory (the one load that imports onnx_ir and onnxscript), once per model file
    (`analysis_cache`)."""

    def analyze() -> dict[str, str]:
        from onnx_chunk.graph.model_io import load_model
        from onnx_chunk.passes import DEFAULT_CHUNK_SIZE, analyze_metadata

        logger.info("%s carries no chunked-prefill plan; running the passes in memory",
                    model_path)
        return analyze_metadata(load_model(model_path),
                                chunk_size=chunk_size or DEFAULT_CHUNK_SIZE)

    return cached_plan(model_path, chunk_size, analyze, data_files)


def embedding_table(ports: ModelPorts, model_path: Path,
                    given: np.ndarray | None) -> np.ndarray | None:
    """The [vocab, hidden] table of an inputs_embeds decoder (`given`, else the
    embeddings.npy beside the model, memory-mapped); None for a decoder that takes ids."""
    if ports.token_input != "inputs_embeds":
        return None
    if given is None:
        path = model_path.parent / EMBEDDINGS_FILE
        if not path.is_file():
            raise ModelLoadError(
                f"the decoder takes inputs_embeds, so the runtime needs the embedding table: "
                f"expected {str(path)!r} ([vocab, hidden] .npy) or the embeddings argument")
        given = np.load(path, mmap_mode="r")
    hidden = ports.hidden_size
    if given.ndim != 2 or given.shape[1] != hidden:
        raise ModelLoadError(f"the embedding table must be [vocab, {hidden}], got "
                             f"{list(given.shape)}")
    return given
