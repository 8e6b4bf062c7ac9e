"""The whole-prompt reference: a last-row copy of the graph, and runs that keep a few rows."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx

from onnx_chunk import load
from onnx_chunk.validate import reference
from onnx_chunk.validate.reference import last_row_graph, reference_folder
from onnx_chunk.validate.runs import RunSettings, boundaries, reference_run
from tests.exports.corpus import ROOT

from .conftest import CHUNK


def test_the_copy_applies_the_lm_head_to_the_last_row_and_links_the_weights(tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(ROOT / "genai-llama-int4", folder)
    before = sorted(path.name for path in folder.iterdir())
    data = folder / "model.onnx.data"
    with reference_folder() as scratch:
        copy = last_row_graph(folder / "model.onnx", scratch)
        assert copy is not None and copy.parent == scratch
        assert os.stat(copy.parent / "model.onnx.data").st_ino == os.stat(data).st_ino
        assert not (copy.parent / "genai_config.json").is_symlink()  # read as a plain file
        graph = onnx.load(str(copy), load_external_data=False).graph
        logits = next(value for value in graph.output if value.name == "logits")
        assert logits.type.tensor_type.shape.dim[1].dim_value == 1
        ids = np.arange(3, 40)
        with load(copy, provider="cpu", capacity=64, chunk_size=64) as runtime:
            assert runtime.ports.last_row_logits
            last = runtime.open_sequence().prefill(ids)
        with load(folder, provider="cpu", capacity=64, chunk_size=64) as runtime:
            every = runtime.open_sequence().prefill(ids, all_logits=True)
        assert last.shape == every[-1].shape
        assert np.abs(last - every[-1]).max() < 1e-3
    assert not scratch.exists()
    assert os.stat(data).st_nlink == 1
    assert sorted(path.name for path in folder.iterdir()) == before


def test_a_decoder_with_last_row_logits_is_used_as_it_is(reference_model, tmp_path):
    assert last_row_graph(reference_model("last_token_logits"), tmp_path) is None


def test_a_folder_left_by_a_process_that_ended_is_removed(tmp_path):
    dead = tmp_path / "onnx-chunk-validate-999999999-abc"
    mine = tmp_path / f"onnx-chunk-validate-{os.getpid()}-abc"
    for folder in (dead, mine):
        folder.mkdir()
        (folder / "model.onnx.data").write_bytes(b"x")
    reference._remove_stale(tmp_path)
    assert not dead.exists() and mine.exists()


def test_a_reference_run_keeps_the_boundary_rows_not_the_prompt(reference_model):
    settings = RunSettings(provider="cpu", capacity=64, chunk_size=CHUNK, lengths=(19,),
                           new_tokens=3, seed=0, atol=1e-5)
    with load(reference_model("base"), provider="cpu", capacity=64, chunk_size=64) as runtime:
        run = reference_run(runtime, 19, settings)
        with runtime.open_sequence() as sequence:
            from onnx_chunk.validate.prompts import seeded_prompt

            every = sequence.prefill(seeded_prompt(runtime.ports.vocab_size, 19, 0),
                                     all_logits=True)
    assert sorted(run.rows) == boundaries(19, CHUNK) == [7, 15, 18]
    assert all(row.ndim == 1 for row in run.rows.values())
    assert len(run.decode) == 2 and len(run.tokens) == len(run.margins) == 3
    # Each boundary row is the whole forward of its prefix: the same numbers as that row of
    # the whole prompt's forward (float32 on CPU: bit for bit).
    for row, logits in run.rows.items():
        np.testing.assert_array_equal(logits, every[row])


def test_without_a_hard_link_the_copy_is_written_beside_the_model(tmp_path, monkeypatch):
    folder = tmp_path / "export"
    shutil.copytree(ROOT / "genai-llama-int4", folder)

    def no_link(source, target):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(reference.os, "link", no_link)
    with reference_folder() as scratch:
        copy = last_row_graph(folder / "model.onnx", scratch)
    assert copy is not None and copy.parent == folder and copy.name.startswith(".onnx-chunk")
    with load(copy, provider="cpu", capacity=64, chunk_size=64) as runtime:
        assert runtime.ports.last_row_logits
    copy.unlink()


def test_a_killed_validations_links_do_not_fail_the_next_ones_checker(tmp_path):
    """A validation killed mid-reference leaves its folder, hard-linking the weights; the next
    validation removes it before onnx.checker (which refuses several links) reads the model."""
    import tempfile

    from onnx_chunk.validate import Outcome, ValidationOptions, resolve_skip, validate_model

    folder = tmp_path / "export"
    shutil.copytree(ROOT / "genai-llama-fp32", folder)
    stale = Path(tempfile.gettempdir()) / "onnx-chunk-validate-999999999-killed"
    stale.mkdir(exist_ok=True)
    try:
        os.link(folder / "model.onnx.data", stale / "model.onnx.data")
        options = ValidationOptions(chunk_size=CHUNK, provider="cpu",
                                    skip=resolve_skip(["numerics", "cache", "engine"]))
        report = validate_model(folder, options)
        checker = next(check for check in report.checks if check.name == "structure.checker")
        assert checker.outcome is Outcome.PASSED, checker.reason
        assert not stale.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
