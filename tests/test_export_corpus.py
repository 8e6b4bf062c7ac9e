"""The committed corpus of real exports matches its manifest and stays small."""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fixtures" / "exports"
MANIFEST = json.loads((CORPUS / "MANIFEST.json").read_text())
SIZE_LIMIT = 8 * 1024 * 1024


@pytest.mark.parametrize("entry", MANIFEST["fixtures"], ids=lambda entry: entry["name"])
def test_fixture_files_match_the_manifest(entry):
    folder = CORPUS / entry["name"]
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert on_disk == [f["path"] for f in entry["files"]]
    for listed in entry["files"]:
        data = (folder / listed["path"]).read_bytes()
        assert len(data) == listed["bytes"], listed["path"]
        assert hashlib.sha256(data).hexdigest() == listed["sha256"], listed["path"]


def test_every_folder_is_in_the_manifest():
    folders = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
    assert folders == sorted(entry["name"] for entry in MANIFEST["fixtures"])


def test_corpus_stays_under_its_size_limit():
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    assert total < SIZE_LIMIT


def test_git_does_not_ignore_the_model_files():
    models = [str(p) for p in CORPUS.rglob("*") if p.suffix in (".onnx", ".data")]
    assert models
    ignored = subprocess.run(
        ["git", "check-ignore", *models], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if ignored.returncode == 128:
        pytest.skip(f"not a git checkout: {ignored.stderr.strip()}")
    assert ignored.stdout == ""
