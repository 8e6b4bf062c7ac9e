"""The `onnx-chunk` command line: a click group whose commands live one per module."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import click

from onnx_chunk import __version__
from onnx_chunk._onnxruntime_wheels import check_one_wheel, missing_message
from onnx_chunk.errors import InstallError, OnnxChunkError

# Command name -> ("module:attribute", one-line help). Modules are imported only when their
# command runs, so `onnx-chunk --help` does not pay for importing ONNX Runtime.
_COMMANDS = {
    "build-model": ("onnx_chunk.cli.build_model:build_model",
                    "Build a reference decoder with seeded random weights."),
    "chat": ("onnx_chunk.cli.chat:chat",
             "Chat with a model in the terminal, the conversation kept in the KV cache."),
    "convert": ("onnx_chunk.cli.convert:convert",
                "Annotate an exported decoder for chunked prefill."),
    "inspect": ("onnx_chunk.cli.inspect:inspect", "Print a decoder's chunked-prefill plan."),
    "generate": ("onnx_chunk.cli.generate:generate",
                 "Generate with chunked prefill: token ids, or text (--prompt)."),
    "demo": ("onnx_chunk.cli.demo:demo",
             "Build, convert and run the default reference decoder."),
    "validate": ("onnx_chunk.cli.validate:validate",
                 "Check that a decoder is safe for chunked prefill (for CI)."),
    "fix-shapes": ("onnx_chunk.cli.fix_shapes:fix_shapes",
                   "Fix a dynamic decoder's free dimensions into static graphs."),
    "serve": ("onnx_chunk.cli.serve:serve",
              "Serve a model over an OpenAI-compatible HTTP API (needs onnx-chunk[serve])."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = _COMMANDS.get(cmd_name)
        if entry is None:
            return None
        check_one_wheel()
        module_name, attribute = entry[0].split(":")
        command: click.Command = getattr(importlib.import_module(module_name), attribute)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_text) for name, (_, help_text) in
                                sorted(_COMMANDS.items())])


@click.group(cls=_LazyGroup)
@click.version_option(__version__, "-V", "--version", prog_name="onnx-chunk",
                      message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Log what the passes and the runtime do.")
def cli(verbose: bool) -> None:
    """Prepare ONNX LLM decoders for chunked prefill and run them on ONNX Runtime."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwind (running every cleanup) and exit 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


# SIGHUP (the terminal closed) is POSIX-only: on Windows only SIGTERM unwinds.
_TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


@contextmanager
def _termination_unwinds() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into `Terminated` while a command runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_terminated) for signum in _TERMINATING}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI and turn every failure into one line and an exit code."""
    try:
        with _termination_unwinds():
            result = cli.main(args=argv, prog_name="onnx-chunk", standalone_mode=False)
    except Terminated as stop:
        click.echo(f"{stop}; partial output removed", err=True)
        return 128 + stop.signum
    except OnnxChunkError as error:
        click.echo(f"error: {error}", err=True)
        return error.exit_code
    except ModuleNotFoundError as error:
        if error.name != "onnxruntime":
            return _internal_error(error)
        click.echo(f"error: {InstallError(missing_message())}", err=True)
        return InstallError.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.UsageError as error:
        command = error.ctx.command_path if error.ctx is not None else "onnx-chunk"
        click.echo(f"error: {error.format_message()} (see '{command} --help')", err=True)
        return error.exit_code
    except click.ClickException as error:
        click.echo(f"error: {error.format_message()}", err=True)
        return error.exit_code
    except click.exceptions.Exit as error:
        return error.exit_code
    except Exception as error:  # the last line of defence: a CLI user never sees a traceback
        return _internal_error(error)
    # With standalone_mode=False click returns a command's exit code (ctx.exit) as the result.
    return result if isinstance(result, int) else 0


def _internal_error(error: Exception) -> int:
    if os.environ.get("ONNX_CHUNK_DEBUG"):
        raise error
    click.echo(
        f"internal error: {type(error).__name__}: {error} "
        "(set ONNX_CHUNK_DEBUG=1 for the traceback)",
        err=True,
    )
    return 70


def run() -> None:
    sys.exit(main())
