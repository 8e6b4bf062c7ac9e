#!/usr/bin/env python3
"""Stage the onnxruntime-gpu wheel onto a lent GPU machine that reaches no package registry.

The lent machine (Python 3.12, CUDA 13 libraries, CPU onnxruntime only) takes at most 64 MiB of
files per call and stays warm for about 30 s between calls, so the ~250 MB CUDA 13 wheel travels
in parts over back-to-back calls into a folder outside $OUT, and is then installed there with
`pip install --no-index --target`.

Here (a machine with pip access):
    python3 scripts/stage_ort_gpu.py prepare            # download, split, print the call plan
On the GPU machine, back to back, one call per part (each carries .stage/manifest.json and one
part); the call that carries the last part also installs and runs the check:
    python3 scripts/stage_ort_gpu.py receive .stage/part-00
    ...
    python3 scripts/stage_ort_gpu.py receive .stage/part-04 --install && bash scripts/gpu_check.sh
`receive` prints the parts still missing; with `--install` it installs only when none is, and
otherwise exits with status 2 naming them (so the check does not run on a half-staged wheel).
`receive` and `install` use only the standard library and pip, so they run on the bare image.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGE = ROOT / ".stage"
LANDING = Path(os.environ.get("ORT_STAGE_DIR", "/tmp/ort-stage"))
SITE = Path(os.environ.get("ORT_SITE_DIR", "/tmp/ort-site"))
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of the file at `path`, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare(version: str, python_version: str, part_mib: int) -> int:
    STAGE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=STAGE) as download:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--python-version", python_version, "--implementation", "cp",
                   *[arg for platform in PLATFORMS for arg in ("--platform", platform)],
                   "-d", download, f"onnxruntime-gpu=={version}"]
        subprocess.run(command, check=True)
        wheel = next(Path(download).glob("onnxruntime_gpu-*.whl"))
        for old in STAGE.glob("part-*"):
            old.unlink()
        part_size = part_mib << 20
        parts = []
        with wheel.open("rb") as handle:
            for index, block in enumerate(iter(lambda: handle.read(part_size), b"")):
                part = STAGE / f"part-{index:02d}"
                part.write_bytes(block)
                parts.append({"name": part.name, "sha256": sha256_of(part), "bytes": len(block)})
        manifest = {"wheel": wheel.name, "sha256": sha256_of(wheel), "parts": parts}
    manifest_path = STAGE / "manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=2))
    print(f"{manifest['wheel']}: {len(parts)} parts of at most {part_mib} MiB in {STAGE}")
    print("device calls, back to back (the machine stays warm ~30 s between calls):")
    for line in call_plan([str(part["name"]) for part in parts]):
        print(f"  {line}")
    return 0


def call_plan(names: list[str]) -> list[str]:
    """One device call per part; the last one also installs and runs the GPU check."""
    calls = []
    for index, name in enumerate(names):
        command = f"python3 scripts/stage_ort_gpu.py receive .stage/{name}"
        if index == len(names) - 1:
            command += " --install && bash scripts/gpu_check.sh"
        calls.append(f"carry=['.stage/manifest.json', '.stage/{name}']  command='{command}'")
    return calls


def _manifest() -> dict:
    for candidate in (STAGE / "manifest.json", LANDING / "manifest.json"):
        if candidate.exists():
            return json.loads(candidate.read_text())
    raise SystemExit("error: no manifest.json: carry .stage/manifest.json with every call")


def receive(paths: list[str], then_install: bool = False) -> int:
    manifest = _manifest()
    expected = {part["name"]: part["sha256"] for part in manifest["parts"]}
    LANDING.mkdir(parents=True, exist_ok=True)
    if (STAGE / "manifest.json").exists():
        shutil.copy(STAGE / "manifest.json", LANDING / "manifest.json")
    for path in map(Path, paths):
        if expected.get(path.name) != sha256_of(path):
            raise SystemExit(f"error: {path} does not match the manifest (corrupt transfer?)")
        shutil.copy(path, LANDING / path.name)
        print(f"received {path.name}")
    missing = _missing(manifest)
    have = len(expected) - len(missing)
    print(f"{have}/{len(expected)} parts in {LANDING}; missing: "
          f"{', '.join(missing) if missing else 'none'}")
    if not then_install:
        return 0
    if missing:
        print(f"error: not installing, parts not yet received: {', '.join(missing)}; send "
              "each with receive first", file=sys.stderr)
        return 2
    return install()


def _missing(manifest: dict) -> list[str]:
    return [p["name"] for p in manifest["parts"] if not (LANDING / p["name"]).exists()]


def install() -> int:
    manifest = _manifest()
    missing = _missing(manifest)
    if missing:
        raise SystemExit(f"error: parts not yet received: {', '.join(missing)}")
    wheel = LANDING / manifest["wheel"]
    with wheel.open("wb") as out:
        for part in manifest["parts"]:
            out.write((LANDING / part["name"]).read_bytes())
    if sha256_of(wheel) != manifest["sha256"]:
        raise SystemExit("error: the joined wheel does not match its sha256")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--upgrade", "--target", str(SITE), str(wheel)], check=True)
    print(f"installed {manifest['wheel']} into {SITE}; export PYTHONPATH={SITE}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="download and split the wheel (here)")
    prep.add_argument("--version", default="1.31.1")
    prep.add_argument("--python-version", default="3.12")
    prep.add_argument("--part-mib", type=int, default=56)
    rec = commands.add_parser("receive", help="keep parts outside $OUT (on the GPU machine)")
    rec.add_argument("parts", nargs="+")
    rec.add_argument("--install", action="store_true",
                     help="then install, when every part is in (the last part's call)")
    commands.add_parser("install", help="join, verify and install (on the GPU machine)")
    args = parser.parse_args()
    if args.command == "prepare":
        return prepare(args.version, args.python_version, args.part_mib)
    if args.command == "receive":
        return receive(args.parts, then_install=args.install)
    return install()


if __name__ == "__main__":
    sys.exit(main())
