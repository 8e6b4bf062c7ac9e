"""What `convert` writes beside its output: data and companions named for it, nothing of others."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys

import onnx
import pytest

from onnx_chunk import staged_output
from onnx_chunk.cli import main
from onnx_chunk.graph import model_io
from onnx_chunk.graph.metadata import read_plan
from onnx_chunk.graph.model_io import load_model
from tests.cli_output import one_error_line

DATA = "model.onnx.data"


@pytest.fixture
def model_a(reference_model, tmp_path):
    """A copy of the tiny reference decoder's folder (seed 0), free to modify."""
    folder = tmp_path / "A"
    shutil.copytree(reference_model().parent, folder)
    return folder


@pytest.fixture
def model_b(reference_model):
    """Another tiny reference decoder (seed 1): other weights, other tokens."""
    return reference_model(seed=1)


def _snapshot(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_convert_into_a_folder_of_another_model_keeps_its_weights(model_a, model_b):
    (model_a / "genai_config.json").unlink()
    before = _snapshot(model_a)
    assert main(["convert", str(model_b), "-o", str(model_a / "b.onnx")]) == 0
    after = _snapshot(model_a)
    assert {name: after[name] for name in before} == before
    assert (model_a / "b.onnx.data").read_bytes() == (model_b.parent / DATA).read_bytes()
    locations = {entry.value for tensor in onnx.load(str(model_a / "b.onnx"),
                                                     load_external_data=False).graph.initializer
                 for entry in tensor.external_data if entry.key == "location"}
    assert locations == {"b.onnx.data"}
    model_io.load_model(model_a / "b.onnx")


def test_convert_refuses_to_replace_the_genai_config_of_another_model(model_a, model_b, capsys):
    before = _snapshot(model_a)
    assert main(["convert", str(model_b), "-o", str(model_a / "b.onnx")]) == 2
    one_error_line(capsys, "genai_config.json", "another model")
    assert _snapshot(model_a) == before


@pytest.mark.parametrize("content", ['{"model": "x"}', '{"model": {"decoder": [1]}}',
                                     '{"search": 5}'])
def test_convert_refuses_a_malformed_genai_config_in_the_target_folder(model_a, model_b, capsys,
                                                                       content):
    (model_a / "genai_config.json").write_text(content)
    before = _snapshot(model_a)
    assert main(["convert", str(model_b), "-o", str(model_a / "b.onnx")]) == 2
    one_error_line(capsys, "genai_config.json", "must be an object")
    assert _snapshot(model_a) == before


def test_convert_refuses_a_data_file_another_model_references(model_a, model_b, capsys):
    # A's model.onnx keeps its weights in b.onnx.data, the name b.onnx's data would get.
    (model_a / "genai_config.json").unlink()
    (model_a / DATA).rename(model_a / "b.onnx.data")
    proto = onnx.load(str(model_a / "model.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "b.onnx.data"
    (model_a / "model.onnx").write_bytes(proto.SerializeToString())
    before = _snapshot(model_a)
    assert main(["convert", str(model_b), "-o", str(model_a / "b.onnx")]) == 2
    one_error_line(capsys, "b.onnx.data", "external data of")
    assert _snapshot(model_a) == before


def test_convert_names_the_output_in_the_copied_genai_config_and_keeps_the_rest(model_a,
                                                                               tmp_path):
    """The chunk width goes into the model's metadata, never into search.chunk_size, which
    onnxruntime-genai's static-batching og.Engine refuses."""
    out = tmp_path / "out"
    assert main(["convert", str(model_a / "model.onnx"), "-o", str(out / "b.onnx"),
                 "--chunk-size", "16"]) == 0
    source = json.loads((model_a / "genai_config.json").read_text())
    written = json.loads((out / "genai_config.json").read_text())
    assert written["model"]["decoder"]["filename"] == "b.onnx"
    assert "chunk_size" not in written["search"]
    source["model"]["decoder"]["filename"] = "b.onnx"
    assert written == source
    assert sorted(os.listdir(out)) == ["b.onnx", "b.onnx.data", "genai_config.json"]
    assert read_plan(load_model(out / "b.onnx")).chunk_size == 16


def test_convert_in_place_leaves_genai_config_as_it_is(model_a):
    before = (model_a / "genai_config.json").read_bytes()
    assert main(["convert", str(model_a / "model.onnx"), "--in-place", "--chunk-size", "16"]) == 0
    assert (model_a / "genai_config.json").read_bytes() == before
    assert read_plan(load_model(model_a / "model.onnx")).chunk_size == 16


def test_convert_keeps_a_chunk_size_the_source_config_sets(model_a, tmp_path):
    """A search.chunk_size the user wrote is theirs: copied as it is, not changed to the
    converted width."""
    path = model_a / "genai_config.json"
    source = json.loads(path.read_text())
    source["search"]["chunk_size"] = 24
    path.write_text(json.dumps(source))
    assert main(["convert", str(model_a / "model.onnx"), "-o", str(tmp_path / "o" / "model.onnx"),
                 "--chunk-size", "16"]) == 0
    assert json.loads((tmp_path / "o" / "genai_config.json").read_text()) == source


def test_convert_refuses_a_symlinked_companion(model_a, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    (model_a / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    assert main(["convert", str(model_a / "model.onnx"), "-o", str(out)]) == 2
    one_error_line(capsys, "tokenizer.json", "symlink")
    assert not out.exists()


def test_convert_keeps_the_mode_of_companions_and_data(model_a, tmp_path):
    (model_a / "tokenizer.json").write_text("{}")
    for name in ("tokenizer.json", DATA, "genai_config.json"):
        os.chmod(model_a / name, 0o600)
    out = tmp_path / "out"
    assert main(["convert", str(model_a / "model.onnx"), "-o", str(out)]) == 0
    for name in ("tokenizer.json", DATA, "genai_config.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name


def test_interrupted_convert_removes_the_folder_it_created(model_a, tmp_path, monkeypatch,
                                                           capsys):
    def interrupted(source, target, progress):
        target.write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(staged_output, "copy_file", interrupted)
    out = tmp_path / "new" / "out"
    assert main(["convert", str(model_a / "model.onnx"), "-o", str(out)]) == 130
    assert not (tmp_path / "new").exists()


# A convert whose first copy blocks (after writing its file) until stdin gets a line: the
# parent knows the child is mid-copy when "copying" arrives on stdout.
_BLOCKED_CONVERT = """
import sys
from onnx_chunk import staged_output
from onnx_chunk.cli import main

copy = staged_output.copy_file

def blocked(source, target, progress):
    copy(source, target, progress)
    print("copying", flush=True)
    sys.stdin.readline()

staged_output.copy_file = blocked
sys.exit(main(sys.argv[1:]))
"""


def _convert_blocked_mid_copy(model, out):
    child = subprocess.Popen([sys.executable, "-c", _BLOCKED_CONVERT, "convert", str(model),
                              "-o", str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "copying"
    return child


def _staging_left(folder):
    return sorted(folder.glob(".model.onnx.*.staging"))


def test_convert_after_a_killed_convert_removes_its_staging(model_a, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    child = _convert_blocked_mid_copy(model_a / "model.onnx", out)
    child.kill()
    child.communicate()
    assert len(_staging_left(out)) == 1
    assert main(["convert", str(model_a / "model.onnx"), "-o", str(out)]) == 0
    assert _staging_left(out) == []
    model_io.load_model(out / "model.onnx")


def test_convert_leaves_the_staging_of_a_live_writer(model_a, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    child = _convert_blocked_mid_copy(model_a / "model.onnx", out)
    try:
        assert main(["convert", str(model_a / "model.onnx"), "-o", str(out)]) == 0
        assert len(_staging_left(out)) == 1
    finally:
        child.kill()
        child.communicate()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_convert_terminated_by_a_signal_leaves_no_files(model_a, tmp_path, signum):
    out = tmp_path / "new" / "out"
    child = _convert_blocked_mid_copy(model_a / "model.onnx", out)
    child.send_signal(signum)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert not (tmp_path / "new").exists()


def test_stale_staging_needs_an_owner_that_is_gone(tmp_path):
    for name, owner in (("dead", "11"), ("alive", "12"), ("foreign", None), ("junk", "x")):
        folder = tmp_path / f".model.onnx.{name}.staging"
        folder.mkdir()
        if owner is not None:
            (folder / ".owner").write_text(owner)
    stale = staged_output.stale_staging(tmp_path, "model.onnx", alive=lambda pid: pid != 11)
    assert stale == [tmp_path / ".model.onnx.dead.staging"]
