"""scripts/trace_request.py: the modules and threads of one served chat request."""

from __future__ import annotations

import sys

import pytest

from scripts._bench import environment as env

sys.path.insert(0, str(env.ROOT / "scripts"))
import trace_request  # noqa: E402  (a script, imported from its folder)


def test_a_served_request_starts_no_thread_and_its_path_is_listed():
    result = trace_request.trace(trace_request.DEFAULT_MODEL, 2)
    assert result["threads_started"] == []
    modules = result["onnx_chunk_modules"]
    for name in ("onnx_chunk.serve.app", "onnx_chunk.runtime.engine.batch_engine",
                 "onnx_chunk.runtime.runner.model_runner", "onnx_chunk.sampling"):
        assert modules.get(name, 0) > 0, sorted(modules)
    assert "onnxruntime" in result["other_packages"]


@pytest.mark.parametrize("argv", [["--max-tokens", "0"], ["/no/such/model"]])
def test_bad_arguments_are_one_error_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        trace_request.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("error:") == 1
