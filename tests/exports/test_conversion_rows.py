"""No conversion option couples rows: after every option of `onnx-chunk convert` that changes the
graph, a request's logits do not depend on the values of the requests batched beside it.

Each case converts a corpus export with one option, loads it with two engine slots (no prefix
reuse) and runs one target prompt beside a neighbour: the neighbour is submitted first and
decodes while the target prefills alone and then decodes in the same batched forwards (every
decode forward runs both slots). Beside neighbour A, beside A again and beside neighbour B
(other ids, another activation range) the target's greedy tokens and the full log-softmax of
every prompt row and every step are bit-identical. A test below shows the comparison catching
one activation scale per tensor (what `--int8-matmul` wrote before: DynamicQuantizeMatMul).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from onnx_chunk.cli import main
from onnx_chunk.cli.convert import convert as convert_command
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.graph.query_seqlens import query_seqlens_index
from onnx_chunk.runtime import load
from onnx_chunk.sampling import Sampling
from tests.exports.converted import as_per_tensor
from tests.exports.corpus import ROOT

NEW_TOKENS = 6
TARGET_LENGTH = 23
NEIGHBOUR_LENGTH = 31
# Enough that the neighbour still decodes when the target ends (it is cancelled then).
NEIGHBOUR_TOKENS = 400
# Calibration prompts for the quantized KV cases (`--calibrate`, one line of ids each).
CALIBRATION = "1 5 9 13 17 21 25 29 33 37 41 45\n2 4 8 16 32 64 3 6 12 24 48 96\n"


@dataclasses.dataclass(frozen=True)
class Case:
    """One conversion: the export and the options given to `convert`."""

    export: str
    options: tuple[str, ...]
    needs_native: bool = False

    def __str__(self) -> str:
        return f"{self.export}[{' '.join(self.options) or 'defaults'}]"


CASES = (
    Case("genai-llama-int4", ()),
    Case("genai-qwen3-int4", ("--chunk-size", "16", "--max-variants", "3", "--no-int8-matmul")),
    Case("genai-llama-int4", ("--int8-matmul",)),
    Case("genai-qwen3-int4", ("--int8-matmul", "--chunk-size", "16")),
    Case("genai-phi3-int4", ("--int4-block-size", "64")),
    Case("genai-llama-fp32", ("--kv-dtype", "int8", "--calibrate", "CALIBRATION")),
    Case("genai-llama-fp32", ("--kv-dtype", "int8", "--kv-prefill", "kernel",
                              "--calibrate", "CALIBRATION")),
    Case("genai-llama-fp32", ("--kv-dtype", "int4", "--kv-scales", "per-tensor",
                              "--calibrate", "CALIBRATION")),
    Case("optimum-llama-fp32", ("--kv-cache", "gqa")),
    Case("optimum-qwen2-fp32", ("--kv-cache", "onnx24")),
    Case("genai-gemma2-fp32", ("--native-chunks", "off", "--logits-rows", "off")),
    Case("genai-lfm2-int4", ("--native-chunks", "on", "--logits-rows", "on"), needs_native=True),
)
# Options of `convert` that leave the graph as a case above writes it: where it is written,
# whether progress is drawn.
NOT_GRAPH = {"model_path", "output", "in_place", "quiet"}


def _neighbours(vocab: int) -> dict[str, list[int]]:
    """The target and its neighbours: A a spread of ids, B one id repeated (a narrow, extreme
    activation pattern unlike A's)."""
    return {"target": [(11 * index + 5) % vocab for index in range(TARGET_LENGTH)],
            "A": [(7 * index + 3) % vocab for index in range(NEIGHBOUR_LENGTH)],
            "B": [vocab - 1] * NEIGHBOUR_LENGTH}


@dataclasses.dataclass(frozen=True)
class Beside:
    """What the target got beside one neighbour."""

    tokens: list[int]
    logprobs: np.ndarray  # [prompt rows - 1 + new tokens, vocab]


def _beside(folder: Path, neighbour: str) -> Beside:
    """The target's tokens and log-softmax rows, run beside `neighbour` on a fresh runtime."""
    with load(folder, provider="cpu", max_batch=2, prefix_reuse=False) as runtime:
        vocab = runtime.stats.vocab_size
        prompts = _neighbours(vocab)
        other = runtime.submit(prompts[neighbour], NEIGHBOUR_TOKENS, eos_token_id=[])
        next(iter(other.tokens()))  # its prefill is done: it decodes from here on
        target = runtime.submit(prompts["target"], NEW_TOKENS, eos_token_id=[],
                                sampling=Sampling(logprobs=vocab, prompt_logprobs=vocab))
        tokens = target.result(timeout=120)
        assert not other.done, "the neighbour must decode beside the whole target"
        other.cancel()
    rows = [entry for entry in target.prompt_logprobs if entry is not None]
    rows += list(target.logprobs)
    table = np.full((len(rows), vocab), np.nan)
    for index, entry in enumerate(rows):
        assert len(entry.top) == vocab
        ids, values = zip(*entry.top)
        table[index, list(ids)] = values
    return Beside(tokens, table)


def _rows_stay_apart(folder: Path) -> None:
    first, again, other = (_beside(folder, name) for name in ("A", "A", "B"))
    assert len(first.tokens) == NEW_TOKENS
    assert again.tokens == first.tokens and np.array_equal(again.logprobs, first.logprobs), (
        "the same neighbour twice gives other numbers: the target depends on what its "
        "neighbour holds at each step")
    assert other.tokens == first.tokens
    worst = float(np.abs(other.logprobs - first.logprobs).max())
    assert np.array_equal(other.logprobs, first.logprobs), (
        f"the target's log-probabilities move by up to {worst:.3g} with its neighbour's values")


def _convert(case: Case, out: Path) -> Path:
    calibration = out.parent / "calibration.txt"
    calibration.write_text(CALIBRATION)
    options = [str(calibration) if option == "CALIBRATION" else option
               for option in case.options]
    assert main(["convert", str(ROOT / case.export), "-o", str(out), "-q", *options]) == 0
    return out


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_requests_logits_do_not_depend_on_its_neighbours_values(case, tmp_path, capsys):
    if case.needs_native and query_seqlens_index() is None:
        pytest.skip("the installed ONNX Runtime's GroupQueryAttention has no query_seqlens")
    folder = _convert(case, tmp_path / "converted")
    capsys.readouterr()
    _rows_stay_apart(folder)


def test_every_option_of_convert_has_a_case():
    """A new option of `convert` needs a case above, or a reason in NOT_GRAPH."""
    given = {option for case in CASES for option in case.options if option.startswith("--")}
    for parameter in convert_command.params:
        if parameter.name in NOT_GRAPH:
            continue
        flags = set(parameter.opts)
        assert flags & given, f"no case converts with {sorted(flags)}"


def test_the_comparison_catches_one_activation_scale_per_tensor(tmp_path, capsys):
    folder = _convert(Case("genai-llama-int4", ("--int8-matmul",)), tmp_path / "converted")
    capsys.readouterr()
    model = load_model(folder / "model.onnx")
    assert as_per_tensor(model)
    coupled = tmp_path / "per-tensor"
    save_model(model, coupled / "model.onnx", companions_from=folder)
    with pytest.raises(AssertionError, match="neighbour"):
        _rows_stay_apart(coupled)
