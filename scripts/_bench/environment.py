"""What every benchmark needs around the measurements: models, the genai venv, options."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from . import venvs

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "bench-out"
GENAI_VERSION = "0.18.0"
# The peer venv: onnxruntime-genai with the CPU onnxruntime it needs, and transformers (no
# torch; jinja2 renders its chat templates) for the tokenizer and chat-template parity checks.
# Pinned, so a peer's answer only changes when these lines do; the onnxruntime onnx-chunk runs
# on (1.32), so a comparison is of the runtimes, not of two ONNX Runtime releases.
PEER_REQUIREMENTS = (f"onnxruntime-genai=={GENAI_VERSION}", "onnxruntime==1.32.0",
                     "transformers==5.24.0", "jinja2==3.1.6")
EOS_TOKEN_ID = 2


def llama_python(make: bool = False) -> Path:
    """The llama-cpp-python interpreter: $ONNX_CHUNK_LLAMACPP_PYTHON, else the scratch venv's
    under the user's cache (made first when `make`; else it may not exist yet)."""
    if os.environ.get("ONNX_CHUNK_LLAMACPP_PYTHON"):
        return Path(os.environ["ONNX_CHUNK_LLAMACPP_PYTHON"])
    if make:
        return venvs.python(venvs.LLAMACPP)
    return venvs.interpreter(venvs.location(venvs.LLAMACPP))


def common_parser(description: str, *, variant: bool = True) -> argparse.ArgumentParser:
    """Options shared by the benchmark scripts. `variant`: whether the script measures the bench
    decoder's INT4 weights on `--variant int4` (a script that does not leaves the option out,
    so argparse refuses it instead of measuring fp32 under that name)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for models, JSON results and tables (default bench-out/)")
    parser.add_argument("--repetitions", type=int, default=5,
                        help="measurements of each system at each point (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: short prompts, 2 repetitions, 8 new tokens")
    if variant:
        parser.add_argument("--variant", default="base", choices=("base", "int4"),
                            help="the bench decoder's weights: fp32 (base) or INT4")
    parser.add_argument("--model", default=None,
                        help="measure a real-size benchmark model (qwen05-int4, ...; built by "
                             "scripts/make_bench_models.py) or a builder-export folder instead "
                             "of the reference decoder")
    return parser


def named_export(value: str) -> tuple[str, Path]:
    """`export_folder(value)`, or one error line and exit 2 when it is not built or unknown."""
    from .models import BenchModelMissing

    try:
        return export_folder(value)
    except BenchModelMissing as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def source_model(args: argparse.Namespace, preset: str) -> Path:
    """The model a benchmark measures as its exporter wrote it: --model's export, else the
    reference decoder `preset` at --variant."""
    if args.model is None:
        return build_model(args.out, preset, args.variant)
    return named_export(args.model)[1] / "model.onnx"


def served_model(args: argparse.Namespace, preset: str, chunk_size: int,
                 native_chunks: str = "auto") -> Path:
    """The model after `onnx-chunk convert`: --model's export converted at `chunk_size`, else
    the reference decoder `preset` at --variant, converted (`native_chunks`: convert's
    --native-chunks; onnxruntime-genai 0.18 over onnxruntime 1.31 loads only "off")."""
    if args.model is None:
        return converted_model(args.out, preset, args.variant, native_chunks)
    name, folder = named_export(args.model)
    return converted_export(args.out, name, folder, chunk_size, native_chunks)


def build_model(out: Path, preset: str, variant: str = "base") -> Path:
    """The reference decoder `preset`/`variant` under out/models (built once, then reused)."""
    folder = out / "models" / (preset if variant == "base" else f"{preset}-{variant}")
    model = folder / "model.onnx"
    if not (model.is_file() and (folder / "genai_config.json").is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "onnx_chunk", "build-model", preset, "-o",
                        str(folder), "--variant", variant], check=True)
    return model


def compile_package() -> None:
    """Write the bytecode of this checkout's onnx_chunk, as `pip install` does for an installed
    package (and did for genai's venv): an editable checkout run with PYTHONDONTWRITEBYTECODE
    set compiles every module from source at each import (measured here: 0.19 against 0.15 s
    for `import onnx_chunk` + `load`), which a load-time comparison must not charge."""
    import compileall

    compileall.compile_dir(ROOT / "onnx_chunk", quiet=1)


def converted_model(out: Path, preset: str, variant: str = "base",
                    native_chunks: str = "auto") -> Path:
    """The reference decoder `preset`/`variant` converted by `onnx-chunk convert` into
    out/models/<name>-converted (a genai folder: convert writes the genai_config.json beside
    it); built and converted once, then reused."""
    source = build_model(out, preset, variant)
    suffix = "" if native_chunks == "auto" else f"-native-{native_chunks}"
    folder = source.parent.with_name(f"{source.parent.name}-converted{suffix}")
    model = folder / "model.onnx"
    if not (model.is_file() and (folder / "genai_config.json").is_file()):
        subprocess.run([sys.executable, "-m", "onnx_chunk", "convert", str(source), "-o",
                        str(model), "--native-chunks", native_chunks], check=True)
    return model


def export_folder(value: str, root: Path | None = None) -> tuple[str, Path]:
    """(name, folder) of a builder export given as a benchmark model name (``qwen05-int4``,
    built by scripts/make_bench_models.py) or as a folder holding genai_config.json."""
    from .models import ONNX_PRECISIONS, BenchModelMissing, bench_model, parse_name

    folder = Path(value)
    if (folder / "genai_config.json").is_file():
        return folder.resolve().name, folder.resolve()
    if parse_name(value)[1] not in ONNX_PRECISIONS:
        raise BenchModelMissing(f"{value} is a GGUF model; name an ONNX one (e.g. qwen05-int4)")
    return value, bench_model(value, root).parent


# Written beside a converted benchmark folder: the options it was converted with and what
# `convert` said of its matmuls. A folder without it (converted before a default changed) is
# converted again rather than measured under a name it no longer deserves.
CONVERTED_RECORD = "converted-by.json"


def converted_export(out: Path, name: str, folder: Path, chunk_size: int,
                     native_chunks: str = "auto", int4_block_size: int | None = None,
                     int8_matmul: bool | None = None) -> Path:
    """The builder export `folder` converted by `onnx-chunk convert --chunk-size` (and
    `--int4-block-size`, `--int8-matmul` or `--no-int8-matmul` when given; None: convert's
    default) into out/models/<name>-converted-<chunk_size>[-b<block>][-int8|-int4] (converted
    once, then reused)."""
    suffix = "" if native_chunks == "auto" else f"-native-{native_chunks}"
    blocks = [] if int4_block_size is None else ["--int4-block-size", str(int4_block_size)]
    suffix += "" if int4_block_size is None else f"-b{int4_block_size}"
    if int8_matmul is not None:
        blocks.append("--int8-matmul" if int8_matmul else "--no-int8-matmul")
        suffix += "-int8" if int8_matmul else "-int4"
    target = out / "models" / f"{name}-converted-{chunk_size}{suffix}" / "model.onnx"
    options = ["--chunk-size", str(chunk_size), "--native-chunks", native_chunks, *blocks]
    record = target.parent / CONVERTED_RECORD
    done: dict[str, object] = {"options": options, "matmuls": None}
    if (target.is_file() and (target.parent / "genai_config.json").is_file()
            and record.is_file() and json.loads(record.read_text())["options"] == options):
        return target
    print(f"converting {folder} -> {target.parent}", file=sys.stderr)
    printed = subprocess.run([sys.executable, "-m", "onnx_chunk", "convert",
                              str(folder / "model.onnx"), "-o", str(target), *options],
                             check=True, stdout=subprocess.PIPE, text=True).stdout
    done["matmuls"] = next((line.strip() for line in printed.splitlines()
                            if line.strip().startswith("matmuls:")), None)
    record.write_text(json.dumps(done) + "\n")
    return target


def converted_by(tree: Path, source: Path, out: Path, chunk_size: int) -> Path:
    """`source` converted by the `onnx-chunk convert` of another checkout `tree` (its own
    graph inputs and metadata: a baseline that predates one of this checkout's inputs cannot
    run this checkout's conversion) into out/models/<tree's folder name>/<source's folder
    name>-converted-<chunk_size> (converted once, then reused)."""
    tree = tree.resolve()
    target = (out / "models" / tree.name / f"{source.parent.name}-converted-{chunk_size}"
              / "model.onnx")
    if not (target.is_file() and (target.parent / "genai_config.json").is_file()):
        print(f"converting {source} with {tree} -> {target.parent}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "onnx_chunk", "convert", str(source), "-o",
                        str(target), "--chunk-size", str(chunk_size)], check=True,
                       stdout=subprocess.DEVNULL, cwd=tree,
                       env=dict(os.environ, PYTHONPATH=str(tree)))
    return target


def model_config(model: Path) -> dict:
    """Vocabulary size, context length and EOS token ids from the model's genai_config.json
    (`eos_token_id`: the first id, `eos_token_ids`: all of them; builder exports may list
    several)."""
    config = json.loads((model.parent / "genai_config.json").read_text())["model"]
    eos = config["eos_token_id"]
    eos_ids = [int(value) for value in eos] if isinstance(eos, list) else [int(eos)]
    return {"vocab_size": int(config["vocab_size"]),
            "context_length": int(config["context_length"]),
            "eos_token_id": eos_ids[0], "eos_token_ids": eos_ids}


def genai_python(venv: Path) -> Path:
    """The interpreter of the peer venv (created, and PEER_REQUIREMENTS installed, if missing).

    onnxruntime-genai brings the CPU onnxruntime, which must never share a venv with
    onnxruntime-gpu, so it lives in a venv of its own. What it creates or installs is said on
    stderr.
    """
    return venvs.pinned_venv(venv, PEER_REQUIREMENTS)


# The evaluation harness's venv: lm-evaluation-harness with its API models (no torch: the
# `api` extra talks to a server; transformers reads the export's tokenizer), pinned.
LMEVAL_REQUIREMENTS = ("lm-eval[api]==0.4.13", "transformers==5.24.0")


def lmeval_python(venv: Path) -> Path:
    """The interpreter of the harness's venv (created, and LMEVAL_REQUIREMENTS installed, if
    missing: about 4.5 minutes and 930 MB, measured on this 2-core machine). What it creates
    or installs is said on stderr."""
    return venvs.pinned_venv(venv, LMEVAL_REQUIREMENTS)


def worker_argv(python: Path | str, worker: str, request: dict) -> list[str]:
    """The command line of one measurement by `worker` (a module of scripts/_bench)."""
    return [str(python), str(WORKERS / f"{worker}.py"), json.dumps(request)]
