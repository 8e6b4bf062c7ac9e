"""`staged_output.staged_write`: the one staging step of every command that writes files."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest

from onnx_chunk import staged_output
from onnx_chunk.cli import main


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _staging_of(folder, target_name, owner):
    """A staging folder of `target_name` in `folder` as a writer with pid `owner` leaves it."""
    staging = folder / f".{target_name}.{owner}.staging"
    staging.mkdir(parents=True)
    (staging / ".owner").write_text(f"{owner}\n")
    (staging / f"{target_name}.data").write_bytes(b"partial")
    return staging


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_mid_write_leaves_nothing(tmp_path, existing):
    out = tmp_path / "new" / "out"
    if existing:
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("mine")
    with pytest.raises(OSError, match="No space left"):
        with staged_output.staged_write(out, "model.onnx") as staging:
            (staging.path / "model.onnx.data").write_bytes(b"weights")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if existing:
        assert os.listdir(out) == ["keep.txt"]
    else:
        assert not (tmp_path / "new").exists()


def test_an_interrupt_before_publish_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with staged_output.staged_write(tmp_path / "out", "model.onnx") as staging:
            (staging.path / "model.onnx").write_bytes(b"graph")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_the_next_write_of_a_target_removes_a_dead_writers_staging_only(tmp_path):
    dead = _dead_pid()
    stale = _staging_of(tmp_path, "model.onnx", dead)
    live = _staging_of(tmp_path, "model.onnx", os.getpid())
    other_target = _staging_of(tmp_path, "other.onnx", dead)
    ownerless = tmp_path / ".model.onnx.x.staging"
    ownerless.mkdir()
    with staged_output.staged_write(tmp_path, "model.onnx") as staging:
        (staging.path / "model.onnx").write_bytes(b"graph")
        staging.publish(["model.onnx"])
    assert not stale.exists()
    assert live.is_dir() and other_target.is_dir() and ownerless.is_dir()
    assert (tmp_path / "model.onnx").read_bytes() == b"graph"
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        ["model.onnx", live.name, other_target.name, ownerless.name])


def test_the_staging_names_its_writer_while_it_writes(tmp_path):
    with staged_output.staged_write(tmp_path, "model.onnx") as staging:
        assert staging.path.parent == tmp_path
        assert (staging.path / ".owner").read_text().strip() == str(os.getpid())
        assert staged_output.stale_staging(tmp_path, "model.onnx") == []
    assert os.listdir(tmp_path) == []


def test_published_files_keep_their_modes_and_arrive_in_order(tmp_path, monkeypatch):
    source = tmp_path / "source.data"
    source.write_bytes(b"weights")
    os.chmod(source, 0o640)
    out = tmp_path / "out"
    renamed = []
    replace = os.replace

    def recorded(staged, target):
        renamed.append(os.path.relpath(target, out))
        replace(staged, target)

    monkeypatch.setattr(os, "replace", recorded)
    with staged_output.staged_write(out, "model.onnx") as staging:
        staging.copy(source, "sub/model.onnx.data")
        (staging.path / "model.onnx").write_bytes(b"graph")
        os.chmod(staging.path / "model.onnx", 0o600)
        staging.publish(["sub/model.onnx.data", "model.onnx"])
    assert renamed == [os.path.join("sub", "model.onnx.data"), "model.onnx"]
    assert stat.S_IMODE((out / "sub" / "model.onnx.data").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "model.onnx").stat().st_mode) == 0o600
    assert (out / "sub" / "model.onnx.data").read_bytes() == b"weights"
    assert sorted(os.listdir(out)) == ["model.onnx", "sub"]


# A command whose first rename into place blocks until stdin gets a line: the parent knows
# everything is staged when "publishing" arrives on stdout.
_BLOCKED_PUBLISH = """
import os
import sys
from onnx_chunk.cli import main

replace = os.replace

def blocked(staged, target):
    print("publishing", flush=True)
    sys.stdin.readline()
    replace(staged, target)

os.replace = blocked
sys.exit(main(sys.argv[1:]))
"""


def _killed_before_publish(*args: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", _BLOCKED_PUBLISH, *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "publishing", child.communicate()[1]
    child.kill()
    child.communicate()


def _hidden(folder):
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


@pytest.mark.parametrize("command", [
    ["build-model", "tiny"],
    ["build-model", "tiny", "--variant", "static", "--chunk-size", "4", "--capacity", "24"],
    ["fix-shapes", "{model}", "--rows", "4", "--capacity", "24"],
], ids=["build-model", "build-model-static", "fix-shapes"])
def test_a_killed_writers_staging_is_removed_by_the_next_run(reference_model, tmp_path,
                                                             command):
    out = tmp_path / "out"
    args = [arg.format(model=reference_model()) for arg in command] + ["-o", str(out)]
    _killed_before_publish(*args)
    assert len(_hidden(out)) == 1
    assert main(args) == 0
    assert _hidden(out) == []
