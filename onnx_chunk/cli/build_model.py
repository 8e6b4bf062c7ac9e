"""`onnx-chunk build-model`: write a reference decoder with seeded random weights."""

from __future__ import annotations

from pathlib import Path

import click

from onnx_chunk.models import VARIANTS, build_decoder, decoder_config


@click.command("build-model")
@click.argument("preset")
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
              help="Folder to write model.onnx, model.onnx.data and genai_config.json into.")
@click.option("--variant", default="base", show_default=True,
              help=f"One of: {', '.join(VARIANTS)}.")
@click.option("--seed", default=0, show_default=True, type=int, help="Weight seed.")
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
def build_model(preset: str, output: Path, variant: str, seed: int, **sizes: int | None) -> None:
    """Build a reference decoder from PRESET (tiny, small, bench) into a folder."""
    overrides = {name: value for name, value in sizes.items() if value is not None}
    config = decoder_config(preset, variant, **overrides)
    path = build_decoder(output, preset=preset, variant=variant, seed=seed, **overrides)
    data = path.with_name(path.name + ".data")
    click.echo(f"wrote {path} ({variant}, seed {seed})")
    click.echo(f"parameters: {config.parameter_count():,}  external data: "
               f"{data.stat().st_size / 2**20:.1f} MiB")
