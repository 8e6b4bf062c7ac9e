"""Static (fixed-shape) decoders: detected by structure, checked with their own checks."""

from __future__ import annotations

import json

import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.models.static_decoder import build_static_decoder
from onnx_chunk.validate import Outcome, ValidationOptions, validate_model

CHUNK, CAPACITY = 4, 24


@pytest.fixture(scope="module")
def static_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    chunk = build_static_decoder(root / "chunk", "tiny", chunk_size=CHUNK, capacity=CAPACITY)
    decode = build_static_decoder(root / "decode", "tiny", chunk_size=1, capacity=CAPACITY)
    other = build_static_decoder(root / "other", "tiny", chunk_size=1, capacity=16)
    return chunk, decode, other


def _by_name(report):
    return {check.name: check for check in report.checks}


def test_a_static_model_runs_the_static_checks(static_pair):
    chunk, decode, _ = static_pair
    report = validate_model(chunk, ValidationOptions(decode_model=decode, provider="cpu"))
    checks = _by_name(report)
    assert list(checks) == ["structure.checker", "structure.external_data", "static.graph",
                            "static.limits", "static.decode_graph", "static.chunked_vs_whole"]
    assert not report.failed and report.summary()["passed"] == 6
    assert "c=4 rows, capacity C=24, 2 layers" in checks["static.graph"].reason
    assert "L=20, c=4, C=24" in checks["static.limits"].reason
    runs = checks["static.chunked_vs_whole"].details["runs"]
    assert [run["length"] for run in runs] == [1, 3, 4, 5, 10]
    assert all(run["tokens_equal"] and len(run["chunked_tokens"]) == 4 for run in runs)
    assert all(run["logits"] <= 1e-4 and run["kv"] <= 1e-4 for run in runs)
    assert max(run["logits"] for run in runs) > 0.0  # one-row sums differ: tolerance matters


def test_a_tight_tolerance_fails_chunked_vs_whole(static_pair):
    chunk, decode, _ = static_pair
    checks = _by_name(validate_model(chunk, ValidationOptions(decode_model=decode, atol=0.0,
                                                              provider="cpu")))
    check = checks["static.chunked_vs_whole"]
    assert check.outcome is Outcome.FAILED and "> atol 0" in check.reason


def test_bad_limits_and_mismatched_decode_graphs_fail(static_pair):
    chunk, decode, other = static_pair
    checks = _by_name(validate_model(chunk, ValidationOptions(decode_model=decode,
                                                              max_input_len=24)))
    assert checks["static.limits"].outcome is Outcome.FAILED
    assert "no room to decode" in checks["static.limits"].reason
    assert checks["static.chunked_vs_whole"].outcome is Outcome.SKIPPED
    checks = _by_name(validate_model(chunk, ValidationOptions(decode_model=other,
                                                              max_input_len=10)))
    assert "not a multiple of the chunk size" in checks["static.limits"].reason
    checks = _by_name(validate_model(chunk, ValidationOptions(decode_model=other)))
    assert checks["static.decode_graph"].outcome is Outcome.FAILED
    assert "same capacity" in checks["static.decode_graph"].reason


def test_without_a_decode_graph_the_comparison_is_skipped(static_pair, capsys):
    chunk, _, _ = static_pair
    code = main(["validate", str(chunk), "--json"])
    data = json.loads(capsys.readouterr().out)
    outcomes = {item["name"]: item["outcome"] for item in data["checks"]}
    assert code == 0
    assert outcomes["static.decode_graph"] == outcomes["static.chunked_vs_whole"] == "skipped"
    assert outcomes["static.graph"] == outcomes["static.limits"] == "passed"


def test_the_decode_graph_beside_a_built_pair_is_found(tmp_path):
    assert main(["build-model", "tiny", "-o", str(tmp_path), "--variant", "static",
                 "--chunk-size", str(CHUNK), "--capacity", str(CAPACITY)]) == 0
    checks = _by_name(validate_model(tmp_path, ValidationOptions(provider="cpu",
                                                                 lengths=(3, 8))))
    assert checks["static.decode_graph"].outcome is Outcome.PASSED
    assert checks["static.decode_graph"].details["decode_model"] == str(tmp_path / "decode.onnx")
    runs = checks["static.chunked_vs_whole"].details["runs"]
    assert [run["length"] for run in runs] == [3, 8] and all(run["tokens_equal"] for run in runs)


def test_threads_are_refused_for_a_static_decoder(static_pair):
    chunk, decode, _ = static_pair
    with pytest.raises(ConfigError, match=r"threads \(--threads\) .* static decoder"):
        validate_model(chunk, ValidationOptions(decode_model=decode, provider="cpu", threads=1))
