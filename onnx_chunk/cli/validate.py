"""`onnx-chunk validate`: the CI gate that says whether a decoder is safe for chunked prefill."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from onnx_chunk.cli.generate import parse_ids
from onnx_chunk.cli.json_output import dumps as json_dumps
from onnx_chunk.cli.progress import QUIET_OPTION, wanted
from onnx_chunk.errors import OutputError
from onnx_chunk.graph.model_folder import locate_model
from onnx_chunk.graph.model_io import COMPANION_FILES, referenced_data_files
from onnx_chunk.runtime.device.provider import PROVIDER_CHOICES
from onnx_chunk.staged_output import staged_write
from onnx_chunk.static.loading import DECODE_FILE
from onnx_chunk.validate import Report, ValidationOptions, resolve_skip, validate_model
from onnx_chunk.validate.validator import DEFAULT_NEW_TOKENS

if TYPE_CHECKING:
    from click._termui_impl import ProgressBar


class _ProgressBar:
    """A click progress bar on stderr, opened when the planned runs are known."""

    def __init__(self) -> None:
        self._bar: ProgressBar[str | None] | None = None

    def start(self, total: int) -> None:
        if total:
            self._bar = click.progressbar(length=total, label="validating", file=sys.stderr,
                                          item_show_func=lambda label: label)
            self._bar.__enter__()

    def advance(self, label: str) -> None:
        if self._bar is not None:
            self._bar.update(1, label)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)


def model_files(model_path: Path, decode_model: Path | None) -> list[Path]:
    """The files validating `model_path` reads: the decoder(s), their data and companions."""
    decoder = locate_model(model_path).onnx_path
    decoders = [decoder, decode_model if decode_model is not None
                else decoder.with_name(DECODE_FILE)]
    files = [*decoders, *(decoder.parent / name for name in COMPANION_FILES)]
    for path in decoders:
        if path.is_file():
            files.extend(referenced_data_files(path))
    return files


def check_report_path(target: Path, protected: list[Path]) -> None:
    """OutputError when the report would replace a folder or one of the `protected` files."""
    if target.is_dir():
        raise OutputError(f"the JUnit report path {str(target)!r} is a folder; name a file "
                          "in it (for example report.xml)")
    resolved = target.resolve()
    for path in protected:
        if path.resolve() == resolved or (target.exists() and path.exists()
                                          and os.path.samefile(path, target)):
            raise OutputError(f"the JUnit report {str(target)!r} would replace {str(path)!r}, a "
                              "file of the model under validation; write the report elsewhere")


def write_junit(report: Report, target: Path) -> None:
    """Write the JUnit XML into a staging folder beside `target`, then rename it into place."""
    try:
        with staged_write(target.parent, target.name) as staging:
            (staging.path / target.name).write_text(report.to_junit(), encoding="utf-8")
            staging.publish([target.name])
    except OutputError:  # already says what to do; an OSError too, not to be wrapped
        raise
    except OSError as error:
        raise OutputError(f"cannot write the JUnit report {str(target)!r}: "
                          f"{error.strerror or error}; choose a writable path") from error


@click.command("validate")
@click.argument("model_path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (model, checks, "
              "summary).")
@click.option("--junit", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write the results as JUnit XML to this file.")
@click.option("--skip", multiple=True, metavar="NAME",
              help="Skip a check group (structure, numerics, cache, engine, static, reference) "
                   "or one check (e.g. structure.ladder); repeatable.")
@click.option("--lengths", default=None, metavar="N,N,...",
              help="Prompt lengths to run (default: around the chunk boundaries).")
@click.option("--new-tokens", type=click.IntRange(min=1), default=DEFAULT_NEW_TOKENS,
              show_default=True, help="Greedy tokens generated per prompt.")
@click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto",
              show_default=True, help="Execution provider for the runs.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the prompts.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="Chunk width W (default: the model's declared one, else 512).")
@click.option("--atol", type=click.FloatRange(min=0), default=None,
              help="A fixed tolerance on logits and KV (default: max(1e-5 on CPU or 1e-3 on "
                   "CUDA, 4 x the kernels' measured noise floor); static decoders: 1e-4 on "
                   "CPU, 0.25 with int8 activations).")
@click.option("--max-input-len", type=click.IntRange(min=1), default=None,
              help="Static decoders: the max input length L (default: the largest multiple "
                   "of c below C).")
@click.option("--decode-model", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Static decoders: the decode graph (1 row); default decode.onnx beside "
                   "the model.")
@click.option("--reference", type=click.Path(path_type=Path), default=None,
              help="Compare with this decoder of the same vocabulary (the float-cache model "
                   "of a quantized cache, say): logits difference and greedy agreement.")
@click.option("--reference-max-logits-diff", type=float, default=None, metavar="X",
              help="Fail reference.max_logits_diff above X (default: report only).")
@click.option("--reference-min-agreement", type=float, default=None, metavar="P",
              help="Fail reference.greedy_agreement below P in [0, 1] (default: report only).")
@click.option("--exact", is_flag=True,
              help="Run every runtime in exact mode and compare bit for bit (a tolerance of 0; "
                   "docs/row_grouping.md).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="ONNX Runtime's intra-op threads of every session the checks run (default: "
                   "its own, one per core).")
@click.option("--progress/--no-progress", default=None,
              help="Show a progress bar on stderr (default: when stderr is a terminal).")
@QUIET_OPTION
@click.pass_context
def validate(ctx: click.Context, model_path: Path, as_json: bool, junit: Path | None,
             skip: tuple[str, ...], lengths: str | None, new_tokens: int, provider: str,
             seed: int, chunk_size: int | None, atol: float | None, max_input_len: int | None,
             decode_model: Path | None, reference: Path | None,
             reference_max_logits_diff: float | None, reference_min_agreement: float | None,
             exact: bool, threads: int | None, progress: bool | None, quiet: bool) -> None:
    """Check that MODEL_PATH (a .onnx file or its folder) is safe for chunked prefill.

    Exit code 0 when every check passed (or was skipped), 1 when one failed, 2 when the model
    cannot be read or the arguments are wrong.
    """
    options = ValidationOptions(
        skip=resolve_skip(skip),
        lengths=None if lengths is None else tuple(parse_ids(lengths, "--lengths")),
        new_tokens=new_tokens, provider=provider, seed=seed, chunk_size=chunk_size,
        atol=atol, max_input_len=max_input_len, decode_model=decode_model,
        reference=reference, reference_max_logits_diff=reference_max_logits_diff,
        reference_min_agreement=reference_min_agreement, exact=exact, threads=threads)
    if junit is not None:
        protected = model_files(model_path, decode_model)
        if reference is not None and reference.exists():
            protected += model_files(reference, None)
        check_report_path(junit, protected)
    show = progress if progress is not None else wanted(quiet)
    bar = _ProgressBar() if show else None
    try:
        report = validate_model(model_path, options, bar)
    finally:
        if bar is not None:
            bar.close()
    if junit is not None:
        write_junit(report, junit)
    if as_json:
        click.echo(json_dumps(report.to_json(), indent=2, default=str))
    else:
        click.echo(report.to_table())
    ctx.exit(1 if report.failed else 0)
