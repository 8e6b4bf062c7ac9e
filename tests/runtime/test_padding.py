import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_chunk.errors import CapacityError, ConfigError, InputError, ModelStructureError
from onnx_chunk.graph.chunk_plan import PaddingEligibility
from onnx_chunk.ladder import ladder_tiers, padded_width
from onnx_chunk.runtime.runner.padding import (
    PADDING_ENV_VARS,
    QueryAxisShrunk,
    plan_forward,
    resolve_padding,
)

SEED_TIERS = ladder_tiers(512, 4)


def _chunk(rows, past, hidden=None, extra_port_dims=(3,)):
    rng = np.random.default_rng(rows * 7919 + past)
    if hidden is None:
        tokens = rng.integers(0, 1000, size=rows, dtype=np.int64)
    else:
        tokens = rng.standard_normal((rows, hidden)).astype(np.float32)
    ports = {
        "position_ids": np.arange(past, past + rows, dtype=np.int64).reshape(1, rows),
        "token_type_ids": rng.integers(0, 2, size=(1, rows), dtype=np.int64),
        "per_token_features": rng.standard_normal((1, rows, *extra_port_dims)).astype(np.float16),
    }
    return tokens, ports


def test_seed_remainder_is_padded_to_the_first_tier():
    tokens, ports = _chunk(113, past=1024)
    forward = plan_forward(tokens, ports, past=1024, tiers=SEED_TIERS, room=3000,
                           position_ids="position_ids")
    assert (forward.real_rows, forward.width, forward.padded) == (113, 171, True)
    assert forward.next_past == 1137
    assert forward.tokens.shape == (171,)
    assert np.all(forward.tokens[113:] == tokens[-1])
    assert forward.ports["position_ids"].tolist() == [list(range(1024, 1024 + 171))]
    assert forward.ports["per_token_features"].shape == (1, 171, 3)
    assert forward.ports["per_token_features"].dtype == np.float16


@settings(max_examples=150, deadline=None)
@given(chunk_size=st.integers(1, 300), cap=st.integers(2, 6), hidden=st.sampled_from([None, 4]),
       data=st.data())
def test_padding_plan_properties(chunk_size, cap, hidden, data):
    tiers = ladder_tiers(chunk_size, cap)
    rows = data.draw(st.integers(1, chunk_size))
    past = data.draw(st.integers(0, 2000))
    room = data.draw(st.one_of(st.none(), st.integers(rows, chunk_size + 10)))
    tokens, ports = _chunk(rows, past, hidden)
    forward = plan_forward(tokens, ports, past=past, tiers=tiers, room=room,
                           position_ids="position_ids")
    width = forward.width
    assert width == padded_width(rows, tiers, room)
    assert room is None or width <= room
    assert forward.real_rows == rows and forward.padded == (width > rows)
    assert forward.tokens.shape == (width, *tokens.shape[1:])
    assert np.array_equal(forward.tokens[:rows], tokens)
    assert all(np.array_equal(row, tokens[-1]) for row in forward.tokens[rows:])
    for name, array in ports.items():
        widened = forward.ports[name]
        assert widened.shape == (1, width, *array.shape[2:]) and widened.dtype == array.dtype
        assert np.array_equal(widened[:, :rows], array)
        if name == "position_ids":
            assert widened[0].tolist() == list(range(past, past + width))
        else:
            assert all(np.array_equal(widened[:, i], array[:, -1]) for i in range(rows, width))
    # A forward that returns one logits row per query row is cut back to the real rows.
    logits = np.random.default_rng(rows).standard_normal((1, width, 11)).astype(np.float32)
    assert np.array_equal(forward.cut_logits(logits), logits[:, :rows])
    # Fewer rows than the query width: the self-check fires exactly when rows were padded.
    if width > 1:
        shrunk = logits[:, -1:]
        if forward.padded:
            with pytest.raises(QueryAxisShrunk) as caught:
                forward.cut_logits(shrunk)
            assert (caught.value.returned_rows, caught.value.query_rows,
                    caught.value.real_rows) == (1, width, rows)
        else:
            assert np.array_equal(forward.cut_logits(shrunk), shrunk)


@given(st.integers(1, 600))
def test_disabled_pads_nothing(rows):
    tokens, ports = _chunk(rows, past=5)
    forward = plan_forward(tokens, ports, past=5, tiers=SEED_TIERS, position_ids="position_ids",
                           enabled=False)
    assert (forward.width, forward.padded) == (rows, False)
    assert forward.tokens is tokens
    assert all(forward.ports[name] is array for name, array in ports.items())


def test_decode_row_is_never_padded():
    forward = plan_forward(np.array([42]), past=99, tiers=SEED_TIERS)
    assert (forward.width, forward.padded, forward.next_past) == (1, False, 100)


def test_no_tier_fits_near_capacity():
    tokens, ports = _chunk(200, past=4000)
    forward = plan_forward(tokens, ports, past=4000, tiers=SEED_TIERS, room=300)
    assert forward.width == 200 and not forward.padded


def test_shrunk_axis_is_a_model_structure_error_with_a_plain_message():
    forward = plan_forward(np.arange(113), past=0, tiers=SEED_TIERS)
    with pytest.raises(ModelStructureError, match="171 query rows .113 real. returned 1 logits"):
        forward.cut_logits(np.zeros((1, 1, 8), dtype=np.float32))


@pytest.mark.parametrize("shape", [(1, 172, 8), (2, 171, 8), (171, 8)])
def test_logits_with_an_impossible_shape(shape):
    forward = plan_forward(np.arange(113), past=0, tiers=SEED_TIERS)
    with pytest.raises(ModelStructureError):
        forward.cut_logits(np.zeros(shape, dtype=np.float32))


def test_bad_requests():
    tokens, ports = _chunk(10, past=0)
    with pytest.raises(InputError, match="token_type_ids"):
        plan_forward(tokens, {**ports, "token_type_ids": np.zeros((1, 9), np.int64)}, past=0,
                     tiers=SEED_TIERS)
    with pytest.raises(InputError, match="odd"):
        plan_forward(tokens, {"odd": np.zeros(10, np.int64)}, past=0, tiers=SEED_TIERS)
    with pytest.raises(InputError, match="'pos'"):
        plan_forward(tokens, ports, past=0, tiers=SEED_TIERS, position_ids="pos")
    with pytest.raises(InputError, match="at least one row"):
        plan_forward(np.zeros(0, np.int64), past=0, tiers=SEED_TIERS)
    with pytest.raises(InputError, match="past length"):
        plan_forward(tokens, past=-1, tiers=SEED_TIERS)
    with pytest.raises(CapacityError, match="only 9 are left"):
        plan_forward(tokens, past=0, tiers=SEED_TIERS, room=9)


_ENV_VALUES = st.sampled_from([None, "0", "1", "false", "true", "off", "on", "no", "yes", "",
                               " OFF ", "True"])


@settings(max_examples=300)
@given(eligible=st.booleans(),
       reasons=st.lists(st.sampled_from(["recurrent state past.0.conv",
                                         "input 'odd' is not per-token"]), max_size=2),
       requested=st.sampled_from([None, True, False]),
       chunk_env=_ENV_VALUES, genai_env=_ENV_VALUES)
def test_resolve_padding_truth_table(eligible, reasons, requested, chunk_env, genai_env):
    env = {name: value for name, value in zip(PADDING_ENV_VARS, (chunk_env, genai_env))
           if value is not None}
    env_off = [name for name, value in env.items()
               if value.strip().lower() in ("0", "false", "off", "no")]
    plan = PaddingEligibility(eligible, tuple(reasons))
    enabled, reason = resolve_padding(plan, requested, env)
    expected = eligible and (requested if requested is not None else not env_off)
    assert enabled == expected
    assert (reason is None) == enabled
    if not eligible:
        assert reason.startswith("refused by the model")
        assert all(r in reason for r in reasons)
    elif requested is False:
        assert "caller" in reason
    elif not enabled:
        assert env_off[0] in reason


@pytest.mark.parametrize("name", PADDING_ENV_VARS)
def test_bad_env_value_is_a_config_error(name):
    with pytest.raises(ConfigError, match=name):
        resolve_padding(PaddingEligibility(True, ()), None, {name: "maybe"})


def test_process_environment_is_the_default(monkeypatch):
    monkeypatch.setenv("ONNX_GENAI_PREFILL_QUERY_PADDING", "0")
    monkeypatch.delenv("ONNX_CHUNK_PREFILL_QUERY_PADDING", raising=False)
    assert resolve_padding(PaddingEligibility(True, ())) == (
        False, "switched off by ONNX_GENAI_PREFILL_QUERY_PADDING=0")
    assert resolve_padding(PaddingEligibility(True, ()), requested=True) == (True, None)
