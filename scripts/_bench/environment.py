"""What every benchmark needs around the measurements: models, the genai venv, options."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "bench-out"
GENAI_VERSION = "0.18.0"
# The peer venv: onnxruntime-genai with the CPU onnxruntime it needs, and transformers (no
# torch; jinja2 renders its chat templates) for the tokenizer and chat-template parity checks.
# Pinned, so a peer's answer only changes when these lines do.
PEER_REQUIREMENTS = (f"onnxruntime-genai=={GENAI_VERSION}", "onnxruntime==1.31.1",
                     "transformers==5.24.0", "jinja2==3.1.6")
_PEER_PROBE = ("import importlib.metadata as m; "
               "print(' '.join(f'{p}=={m.version(p)}' for p in "
               "('onnxruntime-genai', 'onnxruntime', 'transformers', 'jinja2')))")
EOS_TOKEN_ID = 2


def common_parser(description: str) -> argparse.ArgumentParser:
    """Options shared by the benchmark scripts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder for models, JSON results and tables (default bench-out/)")
    parser.add_argument("--repetitions", type=int, default=5,
                        help="measurements of each system at each point (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: short prompts, 2 repetitions, 8 new tokens")
    parser.add_argument("--variant", default="base", choices=("base", "int4"),
                        help="the bench decoder's weights: fp32 (base) or INT4")
    return parser


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


def converted_model(out: Path, preset: str, variant: str = "base") -> Path:
    """The reference decoder `preset`/`variant` converted by `onnx-chunk convert` into
    out/models/<name>-converted (a genai folder: convert writes the genai_config.json beside
    it); built and converted once, then reused."""
    source = build_model(out, preset, variant)
    folder = source.parent.with_name(f"{source.parent.name}-converted")
    model = folder / "model.onnx"
    if not (model.is_file() and (folder / "genai_config.json").is_file()):
        subprocess.run([sys.executable, "-m", "onnx_chunk", "convert", str(source), "-o",
                        str(model)], check=True)
    return model


def model_config(model: Path) -> dict:
    """Vocabulary size, context length and EOS token id from the model's genai_config.json."""
    config = json.loads((model.parent / "genai_config.json").read_text())["model"]
    return {"vocab_size": int(config["vocab_size"]),
            "context_length": int(config["context_length"]),
            "eos_token_id": int(config["eos_token_id"])}


def genai_python(venv: Path) -> Path:
    """The interpreter of the peer venv (created, and PEER_REQUIREMENTS installed, if missing).

    onnxruntime-genai brings the CPU onnxruntime, which must never share a venv with
    onnxruntime-gpu, so it lives in a venv of its own. What it creates or installs is said on
    stderr.
    """
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", _PEER_PROBE], capture_output=True, text=True,
                           check=False)
    if probe.returncode != 0 or probe.stdout.split() != list(PEER_REQUIREMENTS):
        print(f"installing {' '.join(PEER_REQUIREMENTS)} into {venv}", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *PEER_REQUIREMENTS], check=True)
    return python


def worker_argv(python: Path | str, worker: str, request: dict) -> list[str]:
    """The command line of one measurement by `worker` (a module of scripts/_bench)."""
    return [str(python), str(WORKERS / f"{worker}.py"), json.dumps(request)]
