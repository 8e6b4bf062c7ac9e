"""`onnx-chunk convert`: annotate an exported decoder for chunked prefill."""

from __future__ import annotations

import os
from pathlib import Path

import click
import onnx_ir as ir

from onnx_chunk.calibration import calibrate_kv, read_calibration_file
from onnx_chunk.cli.inspect import plan_summary
from onnx_chunk.cli.progress import QUIET_OPTION, byte_progress, wanted
from onnx_chunk.errors import ConfigError, ModelLoadError
from onnx_chunk.graph.external_data import bytes_to_copy
from onnx_chunk.graph.metadata import read_int8_matmul, read_plan
from onnx_chunk.graph.model_folder import GenaiConfig, locate_model, read_max_positions
from onnx_chunk.graph.model_io import (
    check_weights_readable,
    load_model,
    save_model,
)
from onnx_chunk.passes import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_VARIANTS,
    INT4_BLOCK_SIZES,
    KV_CACHE_TARGETS,
    KV_DTYPES,
    KV_PREFILL_CHOICES,
    KV_SCALES,
    LOGITS_ROWS_CHOICES,
    NATIVE_CHUNKS_CHOICES,
    check_int4_blocks,
    check_int8_matmul,
    check_int8_matmul_options,
    check_kv_prefill,
    check_kv_quantization,
    convert_model,
    prefill_mode,
)
from onnx_chunk.passes.int8_matmul import default_refusal, has_int4_layers

# Copies of at least this much external data get a progress bar.
_PROGRESS_BYTES = 64 << 20


def _default_int8_matmul(model: ir.Model, genai: GenaiConfig | None,
                         block_size: int | None) -> tuple[bool | None, str | None]:
    """Whether the default conversion rewrites `model`'s 4-bit weights as int8 matmuls (None:
    a converted model, whose matmuls stay as they are), and the line saying what it did (None
    for a model without 4-bit weights)."""
    if not has_int4_layers(model):
        return False, None
    if read_plan(model) is not None:
        if read_int8_matmul(model) is not None:
            return None, "int8, as converted before"
        return None, "4-bit, as converted before (--int8-matmul rewrites them)"
    if block_size is not None:
        return False, "4-bit, re-blocked (--int4-block-size keeps 4-bit weights)"
    gpus = [name for name in (genai.providers() if genai is not None else ()) if name != "cpu"]
    if gpus:
        return False, (f"4-bit as exported (genai_config.json targets {', '.join(gpus)}; "
                       "--int8-matmul rewrites them for the CPU)")
    refusal = default_refusal(model)
    if refusal is not None:
        return False, f"4-bit as they are ({refusal})"
    try:
        check_weights_readable(model, "the int8 rewrite (the default for a CPU export)")
    except ModelLoadError as error:
        return False, f"4-bit as exported ({error})"
    return True, ("int8 with one activation scale per row, the default for a CPU export "
                  "(--no-int8-matmul keeps the 4-bit weights)")


def _output_path(model_path: Path, output: Path | None, in_place: bool) -> Path:
    if output is None:
        if not in_place:
            raise ConfigError("no output given; pass -o OUT (a .onnx file or a folder), or "
                              "--in-place to rewrite the input model")
        return model_path
    if output.is_dir() or output.suffix != ".onnx":
        output = output / model_path.name
    same = output.exists() and os.path.samefile(output, model_path)
    if same and not in_place:
        raise ConfigError(f"{str(output)!r} is the input model; pass --in-place to rewrite it, "
                          "or choose another output")
    if in_place and not same:
        raise ConfigError(f"--in-place rewrites the input model, but -o names {str(output)!r}; "
                          "drop one of the two")
    return output


@click.command("convert")
@click.argument("model_path", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Output .onnx file, or a folder to write it into.")
@click.option("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, show_default=True,
              help="Rows per prefill chunk (the ladder's top tier).")
@click.option("--max-variants", type=int, default=DEFAULT_MAX_VARIANTS, show_default=True,
              help="Session variants the runtime may keep (one is the decode shape).")
@click.option("--in-place", is_flag=True, help="Rewrite the input model.")
@click.option("--kv-cache", type=click.Choice(sorted(KV_CACHE_TARGETS)), default="gqa",
              show_default=True,
              help="What a concat-KV decoder is rewritten into: com.microsoft "
                   "GroupQueryAttention, or standard opset 24 TensorScatter + Attention.")
@click.option("--native-chunks", type=click.Choice(NATIVE_CHUNKS_CHOICES), default="auto",
              show_default=True,
              help="Wire GroupQueryAttention's query_seqlens input (right-padded chunks run "
                   "natively): auto where the installed ONNX Runtime has it, on (refused "
                   "where it has not), off.")
@click.option("--logits-rows", type=click.Choice(LOGITS_ROWS_CHOICES), default="auto",
              show_default=True,
              help="Add an optional logits_rows input choosing the query rows the lm_head "
                   "computes (a prefill chunk then computes its last row only): auto where "
                   "the lm_head is found, on (refused where it is not), off.")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=None,
              help="Quantize the GroupQueryAttention KV cache to int8, or int4 packed two a "
                   "byte, with scales calibrated on the float model (see docs/kv_cache.md).")
@click.option("--kv-scales", type=click.Choice(KV_SCALES), default=None,
              help="One scale per KV head and channel, or one per cache (with --kv-dtype; "
                   "default per-channel).")
@click.option("--kv-prefill", type=click.Choice(KV_PREFILL_CHOICES), default=None,
              help="How forwards of 2 rows or more attend over a quantized KV cache: "
                   "dequantized (float32 attention over the cache's dequantized values; the "
                   "default for a cache quantized now) or kernel (GroupQueryAttention's "
                   "quantized kernel, as decode steps; no If node in the graph).")
@click.option("--calibrate", "calibrate_file", type=click.Path(path_type=Path), default=None,
              help="Calibration prompts (with --kv-dtype): a text file, one prompt a line, or "
                   "one line of token ids per prompt; default a built-in set of prompts.")
@click.option("--int4-block-size", type=click.Choice([str(size) for size in INT4_BLOCK_SIZES]),
              default=None,
              help="Quantize the 4-bit MatMulNBits weights again at this block size (ONNX "
                   "Runtime's int8 kernel prefills faster at 128 than at the builder's 32; "
                   "the logits move a little). Default: the weights as they are.")
@click.option("--int8-matmul/--no-int8-matmul", default=None,
              help="Rewrite the layers' 4-bit MatMulNBits as int8 matmuls with one "
                   "activation scale per row (ONNX Runtime's CPU QGEMM: prefill about 2x and "
                   "8-row batches 1.7x faster, one-row decode as fast or, on Zen 4, 0.8x; "
                   "twice the layers' weight bytes; the logits move; CPU only), or keep the "
                   "4-bit weights. Default: rewrite them for a CPU export (float32 "
                   "activations, no GPU provider in genai_config.json), keep them otherwise "
                   "and with --int4-block-size.")
@QUIET_OPTION
def convert(model_path: Path, output: Path | None, chunk_size: int, max_variants: int,
            in_place: bool, kv_cache: str, native_chunks: str, logits_rows: str,
            kv_dtype: str | None, kv_scales: str | None, kv_prefill: str | None,
            calibrate_file: Path | None,
            int4_block_size: str | None, int8_matmul: bool | None, quiet: bool) -> None:
    """Annotate MODEL_PATH for chunked prefill and write it to OUTPUT.

    A standard-ONNX decoder whose KV grows by Concat (Optimum, torch.onnx) is first rewritten
    to GroupQueryAttention at capacity (`--kv-cache onnx24`: to TensorScatter + Attention).
    Weights stay in external data and are copied, never loaded, but for the 4-bit ones that
    --int4-block-size and the int8 matmuls (a CPU export's default) read and write anew;
    OUTPUT's folder gets every file at once or none.
    """
    location = locate_model(model_path)
    model_path = location.onnx_path
    if kv_dtype is None and (kv_scales is not None or calibrate_file is not None):
        given = "--kv-scales" if kv_scales is not None else "--calibrate"
        raise ConfigError(f"{given} applies to a quantized KV cache only; add --kv-dtype "
                          "int8 or int4, or drop it")
    model = load_model(model_path)
    check_kv_prefill(kv_prefill, kv_dtype, prefill_mode(model))
    output = _output_path(model_path, output, in_place)
    block_size = None if int4_block_size is None else int(int4_block_size)
    check_int8_matmul_options(block_size, int8_matmul, model)
    matmuls = None
    if int8_matmul is None:  # the default checks the weights it would read itself
        int8_matmul, matmuls = _default_int8_matmul(model, location.genai, block_size)
    elif int8_matmul:
        check_weights_readable(model, "--int8-matmul")
    if block_size is not None:
        check_weights_readable(model, "--int4-block-size")
        check_int4_blocks(model, block_size)
    if int8_matmul:
        check_int8_matmul(model)
    calibration = None
    if kv_dtype is not None:
        # Every refusal before the calibration runs the float model.
        check_kv_quantization(model, kv_dtype)
        prompts = None if calibrate_file is None else read_calibration_file(calibrate_file)
        source = "built-in prompts" if calibrate_file is None else calibrate_file.name
        calibration = calibrate_kv(model_path, prompts, source=source)
    result = convert_model(model, chunk_size=chunk_size, max_variants=max_variants,
                           max_sequence_length=read_max_positions(model_path.parent),
                           kv_cache=kv_cache, native_chunks=native_chunks,
                           logits_rows=logits_rows, int4_block_size=block_size,
                           int8_matmul=int8_matmul,
                           kv_dtype=kv_dtype,
                           kv_scales=kv_scales or "per-channel", calibration=calibration,
                           kv_prefill=kv_prefill)
    model = result.model
    plan = read_plan(model)
    if in_place and not result.modified:
        click.echo(f"{model_path} is already converted with these settings; nothing written")
        return
    to_copy = bytes_to_copy(model, output.parent.resolve() / output.name)
    with byte_progress("copying weights", wanted(quiet) and to_copy >= _PROGRESS_BYTES) as bar:
        copied = 0

        def progress(count: int) -> None:
            nonlocal copied
            copied += count
            if bar is not None:
                bar(copied, to_copy)

        companions = save_model(model, output, progress=progress,
                                companions_from=model_path.parent)
    click.echo(f"wrote {output}" + (f" (with {', '.join(companions)})" if companions else ""))
    for line in plan_summary(plan):
        click.echo(f"  {line}")
    if matmuls is not None:
        click.echo(f"  matmuls: {matmuls}")
