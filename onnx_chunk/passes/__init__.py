"""The graph passes that prepare a decoder for chunked prefill, and the calls that run them as one
pipeline (`DecoderPipeline`, onnx_ir's Sequential).

Each pass records its findings in the inference metadata (`onnx_chunk.graph.metadata`); the last one
turns them into the declaration the runtime reads. Weights are never read: the passes look at
graph structure, shapes and initializer shapes only; only Int4BlocksPass and Int8MatMulPass,
when asked for (`int4_block_size`, `int8_matmul`), read and rewrite the 4-bit MatMulNBits
weights.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_chunk.errors import ConfigError, ModelStructureError
from onnx_chunk.graph import chunk_plan, metadata
from onnx_chunk.passes.chunked_prefill_declaration import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_VARIANTS,
    ChunkedPrefillDeclarationPass,
)
from onnx_chunk.passes.concat_kv_attention import ConcatKVToGQAPass
from onnx_chunk.passes.concat_kv_layers import find_concat_kv_attention, grows_kv_by_concat
from onnx_chunk.passes.concat_kv_tensor_scatter import ConcatKVToTensorScatterPass
from onnx_chunk.passes.int4_blocks import INT4_BLOCK_SIZES, Int4BlocksPass, check_int4_blocks
from onnx_chunk.passes.int8_matmul import Int8MatMulPass, default_refusal, has_int4_layers
from onnx_chunk.passes.kv_capacity import KVCapacityPass
from onnx_chunk.passes.kv_prefill import (
    KV_PREFILL_CHOICES,
    KVPrefillPass,
    prefill_mode,
    unwrap,
    unwrapped,
)
from onnx_chunk.passes.kv_quantization import (
    CACHE_TYPES,
    KV_DTYPES,
    KV_SCALES,
    Calibration,
    KVCacheQuantizationPass,
    find_quantizable_caches,
)
from onnx_chunk.passes.logits_rows import LOGITS_ROWS_CHOICES, LogitsRowsPass
from onnx_chunk.passes.per_token_ports import PerTokenPortsPass
from onnx_chunk.passes.pipeline import DecoderPipeline, annotation_passes
from onnx_chunk.passes.query_seqlens import NATIVE_CHUNKS_CHOICES, QuerySeqlensPass
from onnx_chunk.passes.recurrent_state import RecurrentStatePass

# What `convert --kv-cache` rewrites a concat-KV decoder into: com.microsoft
# GroupQueryAttention (the builder's layout) or standard opset 24 TensorScatter + Attention.
KV_CACHE_TARGETS = {"gqa": ConcatKVToGQAPass, "onnx24": ConcatKVToTensorScatterPass}

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_VARIANTS",
    "INT4_BLOCK_SIZES",
    "ChunkedPrefillDeclarationPass",
    "ConcatKVToGQAPass",
    "ConcatKVToTensorScatterPass",
    "DecoderPipeline",
    "Int4BlocksPass",
    "Int8MatMulPass",
    "KV_CACHE_TARGETS",
    "KVCacheQuantizationPass",
    "KVCapacityPass",
    "KVPrefillPass",
    "KV_PREFILL_CHOICES",
    "KV_DTYPES",
    "KV_SCALES",
    "LOGITS_ROWS_CHOICES",
    "LogitsRowsPass",
    "NATIVE_CHUNKS_CHOICES",
    "PerTokenPortsPass",
    "QuerySeqlensPass",
    "RecurrentStatePass",
    "analyze",
    "analyze_metadata",
    "check_int4_blocks",
    "check_int8_matmul",
    "int8_matmul_default",
    "check_int8_matmul_options",
    "check_kv_prefill",
    "check_kv_quantization",
    "convert_model",
    "prefill_mode",
    "find_concat_kv_attention",
]

def analyze(model: ir.Model, *, chunk_size: int | None = None,
            max_variants: int = DEFAULT_MAX_VARIANTS,
            max_sequence_length: int | None = None) -> chunk_plan.ChunkPlan:
    """The plan the pipeline would write, leaving the model as it was (`analyze_metadata`)."""
    plan = metadata.read_plan(analyze_metadata(model, chunk_size=chunk_size,
                                               max_variants=max_variants,
                                               max_sequence_length=max_sequence_length))
    assert plan is not None, "the declaration pass always writes the schema version"
    return plan


def analyze_metadata(model: ir.Model, *, chunk_size: int | None = None,
                     max_variants: int = DEFAULT_MAX_VARIANTS,
                     max_sequence_length: int | None = None) -> dict[str, str]:
    """The plan's metadata the pipeline would write, leaving the model as it was.

    With `chunk_size` None the plan keeps the chunk size the model declares (none for an
    unconverted model). A concat-KV decoder the rewrite accepts is planned as rewritten (in a
    copy; `max_sequence_length` as for `convert_model`); one it refuses is planned as it is.
    Raises ModelStructureError for opsets or domains ORT cannot run.
    """
    findings = find_concat_kv_attention(model.graph)
    rewrite = ([ConcatKVToGQAPass(max_sequence_length)]
               if findings.concat_kv and findings.refusal is None else [])
    saved = dict(model.metadata_props)
    with unwrapped(model):
        try:
            result = DecoderPipeline(*rewrite, *annotation_passes(chunk_size, max_variants))(
                model)
            return dict(result.model.metadata_props)
        finally:
            model.metadata_props.clear()
            model.metadata_props.update(saved)


def convert_model(model: ir.Model, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                  max_variants: int = DEFAULT_MAX_VARIANTS,
                  max_sequence_length: int | None = None,
                  kv_cache: str = "gqa", kv_dtype: str | None = None,
                  kv_scales: str = "per-channel",
                  calibration: Calibration | None = None,
                  kv_prefill: str | None = None,
                  native_chunks: str = "auto",
                  logits_rows: str = "auto",
                  int4_block_size: int | None = None,
                  int8_matmul: bool | None = None) -> ir.passes.PassResult:
    """Run the passes as one DecoderPipeline (onnx_ir's Sequential; each pass checks its
    preconditions in `requires()` before it changes anything); `modified` is False when the
    model was already converted so.

    A concat-KV decoder (Optimum, torch.onnx) is first rewritten in a copy, which the
    result's `model` is, into the `kv_cache` target (KV_CACHE_TARGETS: GroupQueryAttention, or
    opset 24 TensorScatter + Attention) at capacity; `max_sequence_length` (config.json's
    max_position_embeddings) is its longest sequence. Any other model is converted in place.
    Raises ModelStructureError for a model without GroupQueryAttention or TensorScatter after
    that (KV capacity annotation does not apply to it), a concat-KV layer the rewrite does not
    recognise, or opsets or domains ORT cannot run, and ConfigError for an impossible chunk
    size or variant cap, or `native_chunks` "on" where the query_seqlens pass cannot wire the
    input (QuerySeqlensPass: "auto" wires it where the installed ONNX Runtime has it, "off"
    never), or `logits_rows` "on" where the lm_head's rows cannot be chosen (LogitsRowsPass:
    "auto" adds the optional `logits_rows` input where they can, "off" removes it).

    With `kv_dtype` ("int8" or "int4") the GroupQueryAttention KV cache is quantized
    (KVCacheQuantizationPass) with `kv_scales` ("per-channel" or "per-tensor") scales from
    `calibration` (`onnx_chunk.calibration.calibrate_kv` on the float model); refused
    (ModelStructureError) when the installed ONNX Runtime's GroupQueryAttention schema takes
    no such cache. `kv_prefill` (KV_PREFILL_CHOICES) says how forwards of many rows attend
    over a quantized cache (KVPrefillPass): "dequantized" (float32 attention over the
    dequantized cache, the default for a cache quantized now), "kernel" (the quantized
    kernel), None keeping what the model has; ConfigError for a float cache.

    With `int4_block_size` (INT4_BLOCK_SIZES) every 4-bit MatMulNBits is re-blocked to it
    (Int4BlocksPass: its weights are quantized again, so the logits move a little); refused
    (ConfigError) for a model without 4-bit MatMulNBits. None leaves the weights as they are.

    With `int8_matmul` True the layers' 4-bit MatMulNBits become int8 MatMulInteger over
    activations quantized with one scale per row (Int8MatMulPass: ONNX Runtime's CPU QGEMM
    prefills faster, and each row's result depends on that row alone; twice the bytes of the
    4-bit weights, and the logits move); refused (ConfigError) for a model without 4-bit
    MatMulNBits, and together with `int4_block_size`. None (the default) rewrites them where
    the pass applies to an export not yet converted (`int8_matmul_default`; `onnx-chunk
    convert` also keeps them for a folder whose genai_config.json names a GPU provider or whose
    weights onnx_ir will not read); False never, and refused (ConfigError) for a model an
    earlier conversion made int8.
    """
    check_int8_matmul_options(int4_block_size, int8_matmul, model)
    if int8_matmul is None:
        int8_matmul = int8_matmul_default(model, int4_block_size)
    was = prefill_mode(model)
    check_kv_prefill(kv_prefill, kv_dtype, was)
    if kv_cache not in KV_CACHE_TARGETS:
        raise ConfigError(f"unknown KV cache target {kv_cache!r}; expected one of "
                          f"{', '.join(KV_CACHE_TARGETS)}")
    if kv_dtype is not None:
        check_quantized_cache_support(kv_dtype)
        if calibration is None:
            raise ConfigError("a quantized KV cache (kv_dtype) needs a calibration of the "
                              "float model: onnx_chunk.calibration.calibrate_kv(model_path)")
    rewrites: list[ir.passes.PassBase] = []
    if grows_kv_by_concat(model.graph):
        rewrites.append(KV_CACHE_TARGETS[kv_cache](max_sequence_length))
    if int4_block_size is not None:
        rewrites.append(Int4BlocksPass(int4_block_size))
    if int8_matmul:
        rewrites.append(Int8MatMulPass())
    if kv_dtype is not None:
        assert calibration is not None
        rewrites.append(KVCacheQuantizationPass(calibration, kv_dtype, kv_scales))
    passes = annotation_passes(chunk_size, max_variants, native_chunks, logits_rows)
    unwrap(model)  # the passes read the kernel-only graph; wrapped again after them
    result = DecoderPipeline(*rewrites, *passes, require_kv_cache=True)(model)
    converted = result.model
    if prefill_mode(converted) is not None:
        KVPrefillPass(kv_prefill or was or "dequantized")(converted)
    return ir.passes.PassResult(converted, modified=result.modified
                                or prefill_mode(converted) != was)


def check_kv_prefill(kv_prefill: str | None, kv_dtype: str | None, current: str | None) -> None:
    """ConfigError for an unknown `kv_prefill`, or one given for a float cache (`current`:
    what `prefill_mode` reads from the model, None for a float cache)."""
    if kv_prefill is None:
        return
    if kv_prefill not in KV_PREFILL_CHOICES:
        raise ConfigError(f"unknown KV prefill {kv_prefill!r}; expected one of "
                          f"{', '.join(KV_PREFILL_CHOICES)}")
    if kv_dtype is None and current is None:
        raise ConfigError("--kv-prefill applies to a quantized KV cache only; add --kv-dtype "
                          "int8 or int4, or drop it")


def int8_matmul_default(model: ir.Model, int4_block_size: int | None) -> bool:
    """What `convert_model`'s default does with the 4-bit weights: rewrite them as int8 matmuls
    (True) where Int8MatMulPass applies (`int8_matmul.default_refusal`) and no re-blocking to
    `int4_block_size` was asked for."""
    return (int4_block_size is None and has_int4_layers(model)
            and default_refusal(model) is None)


def check_int8_matmul_options(int4_block_size: int | None, int8_matmul: bool | None,
                              model: ir.Model | None = None) -> None:
    """ConfigError for `--int8-matmul` with `--int4-block-size` (it replaces the 4-bit weights
    a re-blocking would write), and for `--no-int8-matmul` (False) on a `model` whose layers an
    earlier conversion made int8 (the 4-bit weights are gone)."""
    if int8_matmul and int4_block_size is not None:
        raise ConfigError("--int8-matmul replaces the 4-bit weights --int4-block-size would "
                          "re-block; give one of them")
    if (int8_matmul is False and model is not None
            and metadata.read_int8_matmul(model) is not None):
        raise ConfigError("--no-int8-matmul keeps 4-bit weights, and this model's layers are "
                          "int8 matmuls already (an earlier conversion replaced its 4-bit "
                          "weights); convert the original export with --no-int8-matmul")


def check_int8_matmul(model: ir.Model) -> None:
    """Before any work: the refusals of `--int8-matmul` on `model` (Int8MatMulPass rules 1-3),
    none for a model it already rewrote."""
    Int8MatMulPass().requires(model)


def check_kv_quantization(model: ir.Model, kv_dtype: str) -> None:
    """Before any calibration: ModelStructureError when the KV cache of `model` cannot be
    quantized to `kv_dtype` (no such cache in this ONNX Runtime, attention that is not
    GroupQueryAttention, a concat-KV decoder not yet converted, a node the rewrite cannot
    apply to)."""
    check_quantized_cache_support(kv_dtype)
    findings = find_concat_kv_attention(model.graph)
    if findings.concat_kv and findings.refusal is None:
        raise ModelStructureError(
            "the model grows its KV cache by Concat, and calibration runs the float model "
            "through the runtime, which serves it converted: convert it first (onnx-chunk "
            "convert MODEL -o FOLDER --kv-cache gqa), then quantize the converted model's cache "
            "(onnx-chunk convert FOLDER --in-place --kv-dtype ...)")
    with unwrapped(model):
        find_quantizable_caches(model, kv_dtype)


def check_quantized_cache_support(kv_dtype: str) -> None:
    """ModelStructureError when the installed ONNX Runtime's GroupQueryAttention schema takes no
    `kv_dtype` cache (read from its schema, never from its version)."""
    from onnx_chunk.ort_schemas import gqa_cache_types

    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"unknown KV cache dtype {kv_dtype!r}; expected one of "
                          f"{', '.join(KV_DTYPES)}")
    wanted = f"tensor({CACHE_TYPES[kv_dtype].name.lower()})"
    if wanted not in gqa_cache_types():
        import onnxruntime

        raise ModelStructureError(
            f"the installed ONNX Runtime ({onnxruntime.__version__}) has no GroupQueryAttention "
            f"with a {kv_dtype} KV cache (its schema takes no {wanted} cache with k_scale and "
            "kv_cache_bit_width); install an ONNX Runtime whose GroupQueryAttention has one")
