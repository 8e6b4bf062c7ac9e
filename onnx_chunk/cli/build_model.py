"""`onnx-chunk build-model`: write a reference decoder with seeded random weights."""

from __future__ import annotations

from pathlib import Path

import click

from onnx_chunk.errors import ConfigError, OutputError
from onnx_chunk.graph.model_folder import check_utf8_path
from onnx_chunk.models import DTYPES, VARIANTS, build_decoder, decoder_config
from onnx_chunk.models.static_decoder import build_static_pair

STATIC_VARIANT = "static"


@click.command("build-model")
@click.argument("preset")
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
              help="Folder to write model.onnx, model.onnx.data and genai_config.json into.")
@click.option("--variant", default="base", show_default=True,
              help=f"One of: {', '.join(VARIANTS)}, {STATIC_VARIANT} (fixed shapes, needs "
                   "--chunk-size and --capacity; writes model.onnx with c rows and "
                   "decode.onnx with 1 row, sharing model.onnx.data).")
@click.option("--chunk-size", type=int, help="static only: the query rows c (at least 2).")
@click.option("--capacity", type=int, help="static only: the KV capacity C.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
              help="Weight seed.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPES),
              help="Precision of weights, activations, KV and logits; float16 for CUDA, "
                   "whose GroupQueryAttention kernel has no float32 version.")
@click.option("--layers", "num_layers", type=int, help="Number of decoder layers.")
@click.option("--hidden", "hidden_size", type=int, help="Hidden size.")
@click.option("--heads", "num_heads", type=int, help="Attention heads.")
@click.option("--kv-heads", "num_kv_heads", type=int, help="Key/value heads (divides heads).")
@click.option("--head-size", "head_size", type=int,
              help="Head size (default: hidden // heads when those change).")
@click.option("--vocab", "vocab_size", type=int, help="Vocabulary size.")
@click.option("--max-positions", "max_positions", type=int,
              help="Context length (rotary cache rows).")
@click.option("--intermediate", "intermediate_size", type=int, help="MLP intermediate size.")
def build_model(preset: str, output: Path, variant: str, seed: int, dtype: str,
                chunk_size: int | None, capacity: int | None, **sizes: int | None) -> None:
    """Build a reference decoder from PRESET (tiny, small, bench) into a folder."""
    check_utf8_path(output, OutputError)
    overrides = {name: value for name, value in sizes.items() if value is not None}
    if variant == STATIC_VARIANT:
        if chunk_size is None or capacity is None:
            raise ConfigError("--variant static needs --chunk-size and --capacity")
        if dtype != "float32":
            raise ConfigError(f"--variant static is built in float32 only, got --dtype {dtype}; "
                              "drop --dtype or choose a dynamic variant")
        chunk, decode = build_static_pair(output, preset, chunk_size=chunk_size,
                                          capacity=capacity, seed=seed, **overrides)
        click.echo(f"wrote {chunk} (static chunk graph, rows {chunk_size}, capacity {capacity}, "
                   f"seed {seed})")
        click.echo(f"wrote {decode} (static decode graph, rows 1, same weights)")
        return
    if chunk_size is not None or capacity is not None:
        raise ConfigError("--chunk-size and --capacity apply to --variant static only")
    config = decoder_config(preset, variant, **overrides)
    path = build_decoder(output, preset=preset, variant=variant, seed=seed, dtype=dtype,
                         **overrides)
    data = path.with_name(path.name + ".data")
    click.echo(f"wrote {path} ({variant}, {dtype}, seed {seed})")
    click.echo(f"parameters: {config.parameter_count():,}  external data: "
               f"{data.stat().st_size / 2**20:.1f} MiB")
