"""Sliding windows and the KV capacity: a window-sized cache cannot be shorter than its window,
so validate runs at a capacity that holds every window, and what cannot is refused up front."""

from __future__ import annotations

import json

import onnx
import pytest

from onnx_chunk import load
from onnx_chunk.cli import main
from onnx_chunk.errors import ConfigError
from onnx_chunk.graph.chunk_plan import (
    KVBinding,
    check_window_capacity,
    widest_window,
    window_capacity,
)
from tests.exports.corpus import ROOT

from .mutations import copy_model, edit_graph

WIDE = ROOT / "genai-gemma2-w4096-fp32"  # gemma2, sliding_window 4096, context_length 4096
WINDOW = 4096


def _run(capsys, *args):
    capsys.readouterr()
    code = main(["validate", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_window_as_wide_as_the_context_validates_at_a_capacity_that_holds_it(capsys):
    # Default lengths at W=512 ask for 1195 + 4 + 512 = 1711 positions; the window needs 4096.
    code, out, err = _run(capsys, WIDE, "--provider", "cpu", "--json", "--no-progress")
    report = json.loads(out)
    assert code == 0, err + out
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["numerics.greedy_tokens"]["details"]["capacity"] == WINDOW
    assert f"capacity {WINDOW}" in checks["numerics.logits"]["reason"]
    assert checks["engine.batched_decode"]["outcome"] == "passed"
    assert report["summary"]["failed"] == 0


def test_a_window_wider_than_the_models_length_is_refused_with_one_line(tmp_path, capsys):
    model = copy_model(WIDE / "model.onnx", tmp_path / "model")

    def widen(proto: onnx.ModelProto) -> None:
        node = next(node for node in proto.graph.node if node.op_type == "GroupQueryAttention"
                    and any(a.name == "local_window_size" and a.i == WINDOW
                            for a in node.attribute))
        next(a for a in node.attribute if a.name == "local_window_size").i = 2 * WINDOW

    edit_graph(model, widen)
    code, out, err = _run(capsys, model.parent, "--provider", "cpu")
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error:"), err
    assert f"at least {2 * WINDOW}" in err and f"maximum sequence length is {WINDOW}" in err


def _binding(name: str, window: int | None) -> KVBinding:
    return KVBinding(input=name, output=name.replace("past_key_values", "present"),
                     capacity_axis=2, window=window)


def test_the_capacity_a_model_needs_is_its_widest_window():
    bindings = [_binding("past_key_values.0.key", 32), _binding("past_key_values.1.key", None),
                _binding("past_key_values.2.key", 4096)]
    assert widest_window(bindings).input == "past_key_values.2.key"
    assert window_capacity(bindings, limit=4096) == 4096
    assert window_capacity(bindings[1:2], limit=16) == 0 and widest_window(bindings[1:2]) is None
    with pytest.raises(ConfigError, match="at least 4096, but the model's maximum"):
        window_capacity(bindings, limit=2048)
    check_window_capacity(bindings, 4096)
    with pytest.raises(ConfigError, match=r"capacity 1711 is below the sliding window of 4096 "
                                          r"positions of 'past_key_values.2.key'.*at least 4096"):
        check_window_capacity(bindings, 1711)


def test_load_refuses_a_capacity_below_a_window_before_running_anything():
    with pytest.raises(ConfigError, match=f"at least {WINDOW}"):
        runtime = load(WIDE, provider="cpu", capacity=1000)
        runtime.generate_many([[1, 2, 3]], 2)
