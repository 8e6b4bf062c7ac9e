"""`onnx-chunk fix-shapes`: a dynamic decoder into a fixed-shape chunk graph and decode graph."""

from __future__ import annotations

import click

from onnx_chunk.cli.progress import QUIET_OPTION, byte_progress, wanted
from onnx_chunk.errors import ConfigError


def _parse_dims(entries: tuple[str, ...]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not sep or not name or not value.strip().isdigit():
            raise ConfigError(f"--dim expects NAME=VALUE with a positive integer VALUE, got "
                              f"{entry!r}")
        if name.strip() in dims:
            raise ConfigError(f"--dim {name.strip()} is given twice; give each name once")
        dims[name.strip()] = int(value)
    return dims


@click.command("fix-shapes")
@click.argument("model", type=click.Path())
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder for chunk.onnx, decode.onnx and their shared external data.")
@click.option("--rows", required=True, type=int, help="Query rows c of the chunk graph.")
@click.option("--capacity", type=int, default=None,
              help="KV capacity C (past and attention-mask length); needed when it is free.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Fix any other free dim_param by name (repeatable); the rows are set by "
                   "--rows only.")
@QUIET_OPTION
def fix_shapes(model: str, out_dir: str, rows: int, capacity: int | None,
               dims: tuple[str, ...], quiet: bool) -> None:
    """Fix MODEL's free dimensions: a chunk graph (rows c) and a decode graph (rows 1).

    MODEL is a .onnx file or its folder.
    """
    from onnx_chunk.graph.model_folder import locate_model
    from onnx_chunk.static.fix_shapes import fix_shapes as fix

    with byte_progress("hashing and copying weights", wanted(quiet)) as progress:
        result = fix(locate_model(model).onnx_path, out_dir, rows=rows, capacity=capacity,
                     dims=_parse_dims(dims), progress=progress)
    click.echo(f"chunk graph:  {result.chunk_model} (rows {result.chunk_rows})")
    click.echo(f"decode graph: {result.decode_model} (rows {result.decode_rows})")
    if result.capacity is not None:
        click.echo(f"KV capacity:  {result.capacity}")
    click.echo("fixed dims:   " + ", ".join(f"{name}={value}" for name, value in
                                            sorted(result.chunk_dims.items())))
    for path in result.data_files:
        click.echo(f"shared data:  {path}")
    if result.free_outputs:
        click.echo("still free:   " + ", ".join(result.free_outputs))
