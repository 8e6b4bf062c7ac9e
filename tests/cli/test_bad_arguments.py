"""Bad arguments on every command: one `error:` line and exit 2, never exit 70, no folder left."""

import errno
import os
import shutil

import pytest

from onnx_chunk import models
from onnx_chunk.cli import main
from tests.cli_output import one_error_line


def _generate(model, *args):
    return ["generate", str(model), "--max-new-tokens", "2", "--provider", "cpu",
            "--capacity", "64", *args]


@pytest.mark.parametrize("argv", [
    lambda model, tmp: _generate(model, "--random-prompt", "3", "--seed", "-1"),
    lambda model, tmp: ["demo", "--seed", "-1", "--out", str(tmp / "demo")],
    lambda model, tmp: ["build-model", "tiny", "-o", str(tmp / "built"), "--seed", "-1"],
], ids=["generate", "demo", "build-model"])
def test_a_negative_seed_is_refused(reference_model, tmp_path, capsys, argv):
    assert main(argv(reference_model(), tmp_path)) == 2
    one_error_line(capsys, "--seed")
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [b"\xff\xfe1 2 3\n", b"1 2 \x80\x81\n", b"\x00\x01\x02\xff"])
def test_an_ids_file_that_is_not_utf8_text_is_refused(reference_model, tmp_path, capsys,
                                                      content):
    ids = tmp_path / "ids.txt"
    ids.write_bytes(content)
    assert main(_generate(reference_model(), "--ids-file", str(ids))) == 2
    one_error_line(capsys, "ids.txt")


@pytest.mark.parametrize("ids", ["\u0661,\u0662", "1_0", "\uff11", "2.0", "0x1"])
def test_ids_take_ascii_digits_only(reference_model, capsys, ids):
    assert main(_generate(reference_model(), "--ids", ids)) == 2
    one_error_line(capsys, "--ids", "digits 0-9")


def test_generate_refuses_a_path_that_is_not_utf8(reference_model, tmp_path, capsys):
    folder = tmp_path / "x\udcff"
    shutil.copytree(reference_model().parent, folder)
    assert main(_generate(folder / "model.onnx", "--ids", "1,2")) == 2
    one_error_line(capsys, "not valid UTF-8")


@pytest.mark.parametrize("eos", ["-1", "256"])
def test_generate_refuses_an_eos_id_outside_the_vocabulary(reference_model, capsys, eos):
    assert main(_generate(reference_model(), "--ids", "1,2", "--eos-token-id", eos)) == 2
    one_error_line(capsys, "--eos-token-id")


def test_generate_takes_several_eos_ids(reference_model, capsys):
    assert main(_generate(reference_model(), "--ids", "1,2,3", "--eos-token-id", "7",
                          "--eos-token-id", "9", "--json")) == 0


def test_build_model_refuses_sizes_it_cannot_hold_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "new" / "big"
    assert main(["build-model", "tiny", "-o", str(out), "--hidden", "1000000",
                 "--vocab", "1000000"]) == 2
    one_error_line(capsys, "parameters", "choose smaller sizes")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                     MemoryError(), KeyboardInterrupt()])
def test_a_failed_build_removes_the_folder_it_created(tmp_path, monkeypatch, capsys, failure):
    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(models, "make_weights", fail)
    out = tmp_path / "new" / "model"
    assert main(["build-model", "tiny", "-o", str(out)]) in (2, 130)
    assert not (tmp_path / "new").exists()


def test_a_failed_build_keeps_a_folder_that_was_there(tmp_path, monkeypatch, capsys):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(models, "make_weights", disk_full)
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["build-model", "tiny", "-o", str(tmp_path)]) == 2
    one_error_line(capsys, "No space left")
    assert [path.name for path in tmp_path.iterdir()] == ["keep.txt"]


@pytest.fixture(scope="module")
def static_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("static-pair")
    assert main(["build-model", "tiny", "-o", str(out), "--variant", "static", "--chunk-size",
                 "8", "--capacity", "64"]) == 0
    return out / "model.onnx"


def test_generate_refuses_a_static_decoder_at_a_path_that_is_not_utf8(static_pair, tmp_path,
                                                                     capsys):
    folder = tmp_path / "x\udcff"
    shutil.copytree(static_pair.parent, folder)
    assert main(["generate", str(folder / "model.onnx"), "--ids", "1,2", "--max-new-tokens",
                 "2", "--provider", "cpu"]) == 2
    one_error_line(capsys, "not valid UTF-8")


@pytest.mark.parametrize("variant", [[], ["--variant", "static", "--chunk-size", "8",
                                          "--capacity", "64"]], ids=["base", "static"])
def test_build_model_refuses_an_output_path_that_is_not_utf8(tmp_path, capsys, variant):
    out = tmp_path / "x\udcff"
    assert main(["build-model", "tiny", "-o", str(out), *variant]) == 2
    one_error_line(capsys, "not valid UTF-8")
    assert not out.exists()


@pytest.mark.parametrize("eos, words", [
    (["--eos-token-id", "-1"], ("--eos-token-id", "at least 0")),
    (["--eos-token-id", "256"], ("--eos-token-id", "at most 255")),
    (["--eos-token-id", "3", "--eos-token-id", "256"], ("--eos-token-id", "at most 255")),
    (["--temperature", "0.5"], ("--temperature cannot be used with token ids",)),
    (["--top-p", "0.9", "--seed", "3"], ("--top-p cannot be used with token ids",)),
])
def test_generate_on_a_static_decoder_checks_its_eos_ids_and_refuses_sampling_options(
        static_pair, capsys, eos, words):
    assert main(["generate", str(static_pair), "--ids", "1,2", "--max-new-tokens", "2",
                 "--provider", "cpu", *eos]) == 2
    one_error_line(capsys, *words)


@pytest.mark.parametrize("variant", [[], ["--variant", "static", "--chunk-size", "8",
                                          "--capacity", "64"]], ids=["base", "static"])
def test_build_model_on_a_full_disk_removes_the_folder_it_created(tmp_path, monkeypatch, capsys,
                                                                  variant):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", disk_full)
    out = tmp_path / "new" / "model"
    assert main(["build-model", "tiny", "-o", str(out), *variant]) == 2
    one_error_line(capsys, "No space left")
    assert not (tmp_path / "new").exists()
