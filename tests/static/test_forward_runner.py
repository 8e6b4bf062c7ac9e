"""The static runner's forwards go through the runtime's forward interface (`ForwardRunner`):
a prefill chunk or a decode token is a `Forward` of its real rows on the request's slot, and
the padded rows it reports are the alignment's. Its tokens come from the engine's step."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_chunk.runtime.engine.scheduler import Scheduler
from onnx_chunk.runtime.runner.forward import Forward, Row
from onnx_chunk.static.graphs import GraphRunner
from onnx_chunk.static.runner import StaticRunner

from .static_sizes import CAPACITY, CHUNK, MAX_INPUT, SEED


@pytest.fixture(scope="module", params=["rolling", "bound"])
def runner(request, static_models, fixed_pair):
    if request.param == "rolling":
        pair = static_models(CHUNK, CAPACITY, SEED), static_models(1, CAPACITY, SEED)
    else:
        pair = fixed_pair / "chunk.onnx", fixed_pair / "decode.onnx"
    return StaticRunner(*pair, max_input_len=MAX_INPUT, provider="cpu")


@pytest.fixture
def forwards(monkeypatch):
    """Every GraphRunner.run: (runner, real rows, logits asked for, length before, Ran)."""
    seen = []
    run = GraphRunner.run

    def recorded(graph, slot, forward):
        tokens, before = forward.rows[0].tokens.tolist(), forward.rows[0].length.length
        ran = run(graph, slot, forward)
        seen.append((graph, tokens, forward.logits, before, ran))
        return ran

    monkeypatch.setattr(GraphRunner, "run", recorded)
    return seen


def _prompt(length: int) -> list[int]:
    return np.random.default_rng(length).integers(3, 256, length).tolist()


@pytest.mark.parametrize("length", [1, 4, 6, 14, 20])
def test_prefill_and_decode_run_only_through_the_forward_runner(runner, forwards, length):
    result = runner.generate(_prompt(length), 5)
    assert not hasattr(StaticRunner, "run_forward")
    assert len(forwards) == result.chunks + result.decode_steps
    chunks, steps = forwards[:result.chunks], forwards[result.chunks:]
    kept = _prompt(length)[result.truncated_tokens:]
    assert [token for _, tokens, *_ in chunks for token in tokens] == kept
    assert [logits for _, _, logits, *_ in chunks] == ["none"] * (result.chunks - 1) + ["last"]
    assert sum(ran.padded_rows for *_, ran in chunks) == result.pad_count
    assert all(ran.width == CHUNK for *_, ran in chunks)
    # Each forward starts at the real positions fed so far; a decode step feeds the last token.
    befores = [before for *_, before, _ in forwards]
    assert befores == [0, *np.cumsum([len(tokens) for _, tokens, *_ in forwards])[:-1]]
    assert [tokens for _, tokens, *_ in steps] == [[token] for token in result.tokens[:-1]]
    assert all(ran.width == 1 and ran.padded_rows == 0 and ran.logits.shape == (1, 256)
               for *_, ran in steps)
    assert len({id(graph) for graph, *_ in chunks}) == len({id(graph) for graph, *_ in steps}) == 1


def test_a_forward_runner_takes_one_row_of_its_graphs_rows_at_most(runner, forwards):
    prefill = runner.start(_prompt(6), 3)
    graph = forwards[0][0]
    slot = prefill.slot
    valid, length = slot.valid.copy(), slot.length.length
    for forward, words in [
        (Forward([Row(np.arange(3, 3 + CHUNK + 1), slot.length)]), "1 to 4 real rows"),
        (Forward([Row(np.array([], dtype=np.int64), slot.length)]), "1 to 4 real rows"),
        (Forward([Row(np.array([3]), slot.length)] * 2), "one stepping row"),
        (Forward([Row(np.array([3]), slot.length, steps=False)]), "one stepping row"),
        (Forward([Row(np.array([3]), slot.length)], "all"), "not every row"),
    ]:
        with pytest.raises(ValueError, match=words):
            graph.run(slot, forward)
    assert slot.valid.tolist() == valid.tolist() and slot.length.length == length
    ran = graph.run(slot, Forward([Row(np.array([3, 4]), slot.length)], "none"))
    assert ran.logits is None and (ran.width, ran.padded_rows) == (CHUNK, CHUNK - 2)
    assert slot.length.length == length + 2 and len(slot.valid) == len(valid) + CHUNK
    assert slot.valid[len(valid):].sum() == 2


def test_its_tokens_come_from_the_engines_step(runner, monkeypatch):
    # One update per token: the prefill's chunk gives the first, each decode step one more;
    # each is what the scheduler delivered, ended by the one finish rule.
    delivered = []
    update = Scheduler.update

    def counted(scheduler, plan, outputs):
        result = update(scheduler, plan, outputs)
        delivered.append((len(outputs.prefilled), len(outputs.decoded)))
        return result

    monkeypatch.setattr(Scheduler, "update", counted)
    result = runner.generate(_prompt(6), 5)
    assert delivered == [(1, 0)] + [(0, 1)] * 4 and result.finish_reason == "length"
    stop = runner.generate(_prompt(6), 5, eos_token_id=result.tokens[2])
    assert stop.tokens == result.tokens[:3] and stop.finish_reason == "stop"
    assert stop.decode_steps == 2


def test_a_failed_decode_forward_raises_its_error(runner, monkeypatch):
    run = GraphRunner.run

    def failing(graph, slot, forward):
        if graph.spec.rows == 1 and slot.length.length > 7:
            raise RuntimeError("the device went away")
        return run(graph, slot, forward)

    monkeypatch.setattr(GraphRunner, "run", failing)
    with pytest.raises(RuntimeError, match="the device went away"):
        runner.generate(_prompt(6), 5)
