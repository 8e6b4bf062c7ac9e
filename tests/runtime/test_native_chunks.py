"""Native chunks (GroupQueryAttention's query_seqlens): the plan, the mask, and on every export
of the corpus converted natively: padded tokens and logits equal unpadded ones, idle rows of a
batched decode are left untouched without window saves, the engine equals each prompt alone.

Under an ONNX Runtime without the input (CI runs this file again with onnxruntime 1.31) the
exports convert without it and the same parity holds on the "repeat" path.
"""

import dataclasses

import numpy as np
import pytest

from onnx_chunk.cli import main
from onnx_chunk.errors import CapacityError, ConfigError, InputError, ModelStructureError
from onnx_chunk.graph import metadata
from onnx_chunk.graph.model_io import load_model, save_model
from onnx_chunk.graph.query_seqlens import query_seqlens_index
from onnx_chunk.graph.without_query_seqlens import without_query_seqlens
from onnx_chunk.passes import QuerySeqlensPass, convert_model
from onnx_chunk.runtime import facade, load, loading
from onnx_chunk.runtime.device.buffers import BatchBuffers
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.engine.kv_state import LogicalLength
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot, new_slot
from onnx_chunk.runtime.runner.chunk_mask import chunk_mask_kind
from onnx_chunk.runtime.runner.model_runner import Forward, Row
from onnx_chunk.runtime.runner.native_chunks import NativeRow, plan_native
from tests.exports.corpus import fixtures

# Whether the installed ONNX Runtime's GroupQueryAttention takes query_seqlens.
NATIVE = query_seqlens_index() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="the installed ONNX Runtime's "
                                  "GroupQueryAttention has no query_seqlens input")
W = 128
NEW_TOKENS = 12
LENGTHS = (5, 40, 130, 300, 77, 250)
# Prompt lengths per chunk width of the padded-against-unpadded parity: remainders that pad
# to each tier, whole chunks and several chunks (the corpus's capacity is 2048).
PARITY_LENGTHS = {W: LENGTHS, 512: (5, 300, 600, 1100, 777, 513)}


def _ids(values):
    return np.asarray(values, dtype=np.int64)


def test_a_remainder_runs_at_its_tier_with_its_real_rows():
    plan = plan_native([NativeRow(_ids([7, 8, 9, 10, 11]), past=20)], tiers=(4, 8),
                       capacity=64)
    assert plan.width == 8 and plan.query_lens.tolist() == [5]
    assert plan.tokens.tolist() == [[7, 8, 9, 10, 11, 11, 11, 11]]
    assert plan.positions.tolist() == [list(range(20, 28))]
    assert plan.mask_ones.tolist() == [25] and plan.mask_width == 25
    assert plan.last_rows.tolist() == [4] and plan.padded_rows == 3


def test_the_mask_is_never_narrower_than_the_padded_width():
    plan = plan_native([NativeRow(_ids([1, 2, 3]), past=0)], tiers=(8,), capacity=64)
    assert plan.width == 8 and plan.mask_ones.tolist() == [3] and plan.mask_width == 8


def test_several_rows_share_one_width_and_idle_rows_feed_nothing():
    rows = [NativeRow(_ids([1, 2, 3]), past=4), NativeRow(_ids([0]), past=9, steps=False),
            NativeRow(_ids([5, 6, 7, 8, 9, 10]), past=0), NativeRow(_ids([0]), 0, steps=False)]
    plan = plan_native(rows, tiers=(4, 8), capacity=64)
    assert plan.width == 8 and plan.query_lens.tolist() == [3, 0, 6, 0]
    # An idle row holds its length (at least 1: the operator needs T >= 1).
    assert plan.mask_ones.tolist() == [7, 9, 6, 1] and plan.mask_width == 9
    assert plan.last_rows.tolist() == [2, 0, 5, 0] and not plan.tokens[1].any()


def test_padding_off_runs_the_longest_row_as_it_is():
    plan = plan_native([NativeRow(_ids([1, 2, 3]), past=0)], tiers=(8,), capacity=64,
                       padding=False)
    assert plan.width == 3 and plan.padded_rows == 0


def test_every_row_needs_room_for_the_padded_width_unless_every_cache_is_windowed():
    rows = [NativeRow(_ids([1, 2, 3]), past=0), NativeRow(_ids([0]), past=60, steps=False)]
    # 4 positions left at the idle row: the tier 8 does not fit, the exact width does.
    assert plan_native(rows, tiers=(8,), capacity=64).width == 3
    assert plan_native(rows, tiers=(8,), capacity=64, windowed=True).width == 8
    with pytest.raises(CapacityError, match="run the rows apart"):
        plan_native([*rows[:1], NativeRow(_ids([0]), past=62, steps=False)], tiers=(8,),
                    capacity=64)
    with pytest.raises(CapacityError, match="only 2 are left"):
        plan_native([NativeRow(_ids([1, 2, 3]), past=62)], tiers=(8,), capacity=64)
    with pytest.raises(InputError, match="at least one row that steps"):
        plan_native([NativeRow(_ids([0]), past=3, steps=False)], tiers=(8,), capacity=64)


@pytest.mark.parametrize("policy", [MaskPolicy.LOGICAL, MaskPolicy.CAPACITY])
def test_the_chunk_mask_holds_each_rows_count(policy):
    device = dataclasses.replace(device_for("cpu"), mask_policy=policy)
    for rows in (1, 3):
        mask = chunk_mask_kind(policy)(rows, 16, np.dtype(np.int64), device)

        class Binding:
            bound: tuple = ()

            def bind_input(self, name, device_type, device_id, dtype, shape, pointer):
                self.bound = tuple(shape)

            def bind_ortvalue_input(self, name, value):
                self.bound = tuple(value.shape())

        io = Binding()
        mask.bind(io)
        for ones, width in (([5, 2, 9][:rows], 10), ([3, 7, 1][:rows], 8),
                            ([12, 0, 4][:rows], 12)):
            mask.set_counts(io, np.array(ones), width)
            columns = 16 if policy is MaskPolicy.CAPACITY else width
            assert io.bound == (rows, columns)
            held = mask.buffer.host.reshape(-1)[:rows * columns].reshape(rows, columns)
            expected = (np.arange(columns)[None] < np.array(ones)[:, None]).astype(np.int64)
            assert np.array_equal(held, expected)


@pytest.fixture(scope="module")
def native_exports(tmp_path_factory):
    """Every export of the corpus that converts, converted natively (the default here)."""
    out = tmp_path_factory.mktemp("native")
    converted = {}
    for fixture in fixtures():
        if main(["convert", str(fixture.folder), "-o", str(out / fixture.name), "-q"]) == 0:
            converted[fixture.name] = out / fixture.name
    return converted


def _corpus():
    # The builder's fp16 CPU export attends with MultiHeadAttention: nothing to convert.
    return [fixture.name for fixture in fixtures() if fixture.name != "genai-llama-fp16"]


@pytest.mark.parametrize("width", sorted(PARITY_LENGTHS))
@pytest.mark.parametrize("name", _corpus())
def test_padded_native_chunks_give_the_unpadded_tokens_and_logits(native_exports, name, width):
    """At W 128 (tiers 43, 86, 128) and 512 (171, 342, 512): remainders run padded to a tier
    with their real rows as query_seqlens; greedy tokens and prompt logits equal the unpadded
    run exactly (max difference 0.0; INT4 included: every unpadded forward has more than one
    row, prefill_chunks makes sure)."""
    path = native_exports[name]
    padded = load(path, provider="cpu", chunk_size=width, padding=True)
    unpadded = load(path, provider="cpu", chunk_size=width, padding=False)
    assert unpadded.stats.padding == "off"
    windowed = any(port.window is not None for port in padded.debug.ports.kv)
    assert padded.stats.padding == ("off" if padded.debug.ports.state or (windowed and not NATIVE)
                                    else "native" if NATIVE else "repeat")
    rng = np.random.default_rng(7)
    for length in PARITY_LENGTHS[width]:
        prompt = rng.integers(0, padded.stats.vocab_size, length).tolist()
        with padded.open_sequence() as one, unpadded.open_sequence() as other:
            assert np.array_equal(one.prefill(prompt), other.prefill(prompt))
            one.rewind(length)
            other.rewind(length)
            assert one.generate(prompt, NEW_TOKENS, []) == other.generate(prompt, NEW_TOKENS, [])
    if padded.stats.padding != "off":
        assert padded.debug.runner.variants.cache.snapshot().padding_refused is None


def test_a_converted_builder_export_reports_native_padding(native_exports):
    """"native" where ONNX Runtime has query_seqlens (convert wires it), else "repeat"."""
    path = native_exports["genai-llama-fp32"]
    assert load(path, provider="cpu", chunk_size=W, specialize=True).stats.padding == \
        ("native" if NATIVE else "repeat")
    assert load(path, provider="cpu", chunk_size=W).stats.padding == "off"
    raw = next(fixture.folder for fixture in fixtures() if fixture.name == "genai-llama-fp32")
    assert load(raw, provider="cpu", chunk_size=W, padding=True).stats.padding == "repeat"


def _wired_elsewhere(tmp_path, name="genai-llama-fp32"):
    """The export `name` wired as ONNX Runtime 1.32 wires it (input 16), whatever ONNX Runtime
    is installed: a folder converted on another machine; and the same export unwired."""
    source = next(fixture.folder for fixture in fixtures() if fixture.name == name)
    model = convert_model(load_model(source / "model.onnx"), native_chunks="off").model
    save_model(model, tmp_path / "plain" / "model.onnx", companions_from=source)
    QuerySeqlensPass("on", index=16)(model)
    assert metadata.read_query_seqlens(model) == "query_seqlens"
    save_model(model, tmp_path / "wired" / "model.onnx", companions_from=source)
    return tmp_path / "wired", tmp_path / "plain"


def test_a_native_model_runs_the_repeat_path_where_onnx_runtime_lacks_the_input(tmp_path,
                                                                                monkeypatch):
    """Loaded where GroupQueryAttention has no query_seqlens (onnxruntime 1.31 in CI's second
    run, or an ONNX Runtime made to look so), a folder converted natively runs without the
    input: the "repeat" path, the unwired folder's greedy tokens."""
    wired, plain = _wired_elsewhere(tmp_path)
    if NATIVE:
        monkeypatch.setattr(loading, "query_seqlens_index", lambda: None)
    runtime = load(wired, provider="cpu", chunk_size=16, padding=True)
    assert runtime.stats.padding == "repeat" and runtime.debug.ports.query_seqlens is None
    reference = load(plain, provider="cpu", chunk_size=16, padding=True)
    rng = np.random.default_rng(3)
    for length in (5, 21, 40):
        prompt = rng.integers(0, runtime.stats.vocab_size, length).tolist()
        with runtime.open_sequence() as one, reference.open_sequence() as other:
            assert one.generate(prompt, 8, []) == other.generate(prompt, 8, [])


@pytest.mark.parametrize("name", _corpus())
def test_every_corpus_export_converted_natively_elsewhere_runs_here(tmp_path, monkeypatch, name):
    """Each export the pass can wire, loaded where the input is missing: its padding mode and
    greedy tokens are the unwired folder's (gemma2's window, lfm2's state, INT4 included)."""
    try:
        wired, plain = _wired_elsewhere(tmp_path, name)
    except ConfigError as error:  # nothing to wire (no GroupQueryAttention with past KV)
        pytest.skip(str(error))
    if NATIVE:
        monkeypatch.setattr(loading, "query_seqlens_index", lambda: None)
    # genai_config.json sizes the cache; the exports without one get 256 positions.
    capacity = None if (plain / "genai_config.json").is_file() else 256
    runtime = load(wired, provider="cpu", chunk_size=16, capacity=capacity, padding=True)
    reference = load(plain, provider="cpu", chunk_size=16, capacity=capacity, padding=True)
    assert runtime.stats.padding == reference.stats.padding != "native"
    rng = np.random.default_rng(5)
    for length in (7, 37):
        prompt = rng.integers(0, runtime.stats.vocab_size, length).tolist()
        with runtime.open_sequence() as one, reference.open_sequence() as other:
            assert one.generate(prompt, 6, []) == other.generate(prompt, 6, [])


def test_the_unwired_graph_is_the_export_and_metadata_must_match_it(tmp_path):
    """The edit gives every GroupQueryAttention its exported inputs back, drops the graph input
    and the metadata key; a model whose metadata names the input its graph does not feed is
    refused."""
    onnx = pytest.importorskip("onnx")
    wired, plain = _wired_elsewhere(tmp_path)
    edited = onnx.load_from_string(without_query_seqlens((wired / "model.onnx").read_bytes()))
    exported = onnx.load(plain / "model.onnx", load_external_data=False)

    def attention_inputs(model):  # trailing empty names: omitted optional inputs either way
        return [" ".join(node.input).rstrip().split(" ") for node in model.graph.node
                if node.op_type == "GroupQueryAttention"]

    assert attention_inputs(edited) == attention_inputs(exported) != []
    assert "query_seqlens" not in [value.name for value in edited.graph.input]
    assert metadata.QUERY_SEQLENS_KEY not in [entry.key for entry in edited.metadata_props]
    model = load_model(plain / "model.onnx")
    metadata.write_query_seqlens(model, "query_seqlens")
    save_model(model, tmp_path / "lying" / "model.onnx", companions_from=plain)
    with pytest.raises(ModelStructureError, match="no GroupQueryAttention takes"):
        without_query_seqlens((tmp_path / "lying" / "model.onnx").read_bytes())


def _batch_slot(runtime, buffers, rows):
    debug = runtime.debug
    return SequenceSlot(debug.pool.take_number(), buffers,
                        debug.masks(rows, debug.options.capacity, debug.ports.mask_dtype,
                                    debug.device))


@needs_native
@pytest.mark.parametrize("name", ["genai-gemma2-fp32", "genai-llama-fp32", "genai-lfm2-fp32"])
def test_idle_rows_of_a_batched_decode_are_untouched_and_no_window_is_saved(native_exports,
                                                                           name):
    """gemma2's window-sized cache (32 positions) holds more than its rows: today an idle row
    would evict and its rows are saved and written back; natively it is never written."""
    runtime = load(native_exports[name], provider="cpu", chunk_size=16, max_batch=2)
    ports, capacity = runtime.debug.ports, runtime.stats.capacity
    buffers = BatchBuffers(ports.kv, ports.state, runtime.debug.device, 2)
    slots = [new_slot(ports, capacity, runtime.debug.device, runtime.debug.masks,
                      runtime.debug.pool.take_number(), buffers=buffers.slot(index), captures=False)
             for index in range(2)]
    lengths = [LogicalLength(capacity), LogicalLength(capacity)]
    rng = np.random.default_rng(3)
    for slot, length, count in zip(slots, lengths, (60, 75)):
        ids = rng.integers(0, ports.vocab_size, count)
        for begin in range(0, count, 16):
            runtime.debug.runner.run(slot, Forward([Row(ids[begin:begin + 16], length)]))
    kv_before = [buffer.host[1].copy() for buffer in buffers.kv]
    state_before = buffers.slot(1).snapshot_state()
    batch = _batch_slot(runtime, buffers, 2)
    for token in (5, 6, 7):
        runtime.debug.runner.run(batch, Forward([Row(np.array([token]), lengths[0]),
                                           Row(np.array([0]), lengths[1], steps=False)]))
    assert [length.length for length in lengths] == [63, 75]
    assert buffers.saved_rows == 0
    assert all(np.array_equal(before, buffer.host[1])
               for before, buffer in zip(kv_before, buffers.kv))
    assert all(np.array_equal(a, b) for a, b in zip(state_before,
                                                    buffers.slot(1).snapshot_state()))


@pytest.mark.parametrize("name", ["genai-llama-fp32", "genai-gemma2-fp32", "genai-qwen3-int4",
                                  "genai-lfm2-fp32"])
def test_the_native_engine_equals_each_prompt_alone(native_exports, name):
    path = native_exports[name]
    rng = np.random.default_rng(1)
    with load(path, provider="cpu", chunk_size=16, max_batch=3) as batched:
        prompts = [rng.integers(0, batched.stats.vocab_size, n).tolist()
                   for n in (5, 64, 17, 130)]
        tokens = batched.generate_many(prompts, NEW_TOKENS, eos_token_id=[])
    single = load(path, provider="cpu", chunk_size=16)
    for prompt, got in zip(prompts, tokens):
        with single.open_sequence() as sequence:
            assert sequence.generate(prompt, NEW_TOKENS, []) == got


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("name", _corpus())
def test_batched_prefill_equals_each_prompt_alone_at_the_same_slot_count(native_exports,
                                                                        monkeypatch, name,
                                                                        padding):
    """Prompts arriving together prefill natively in forwards [slots, S] where that computes no
    more rows (four 128-row chunks at once here); their greedy tokens equal each prompt
    submitted alone to an engine of the same slots (the batched decode's row count is the
    same)."""
    batched = []
    rng = np.random.default_rng(5)
    with load(native_exports[name], provider="cpu", chunk_size=W, max_batch=4,
              padding=padding, prefix_reuse=False) as runtime:
        runner = runtime.debug.runner
        run = runner.run

        def counted(slot, forward):
            # A forward of several rows with more than one token: prompts' chunks together.
            if len(forward.rows) > 1 and any(len(row.tokens) > 1 for row in forward.rows):
                batched.append(min(len(row.tokens) for row in forward.rows))
            return run(slot, forward)

        monkeypatch.setattr(runner, "run", counted)
        prompts = [rng.integers(0, runtime.stats.vocab_size, n).tolist()
                   for n in (300, 130, 128, 256, 5, 40, 250)]
        alone = [runtime.submit(prompt, NEW_TOKENS, eos_token_id=[]).result()
                 for prompt in prompts]
        assert not batched
        together = runtime.generate_many(prompts, NEW_TOKENS, eos_token_id=[])
    assert together == alone
    if runtime.debug.runner.native:
        # Forwards of several prompts' whole chunks ran (the shortest chunk in one: 128 rows).
        assert max(batched) == W


@pytest.mark.parametrize("name", ["genai-llama-fp32", "genai-gemma2-fp32"])
def test_every_rows_logits_and_verified_drafts_on_native_chunks(native_exports, name):
    """Forwards asking for every row's logits (all_logits prefill, speculative verification)
    cut each padded chunk to its real rows: equal to the unpadded run, and prompt-lookup's
    greedy tokens equal plain decoding."""
    path = native_exports[name]
    padded = load(path, provider="cpu", chunk_size=W, padding=True)
    unpadded = load(path, provider="cpu", chunk_size=W, padding=False)
    prompt = (list(range(3, 40)) * 6)[:200]
    with padded.open_sequence() as one, unpadded.open_sequence() as other:
        rows = one.prefill(prompt, all_logits=True)
        assert rows.shape[0] == len(prompt)
        assert np.array_equal(rows, other.prefill(prompt, all_logits=True))
    drafting = load(path, provider="cpu", chunk_size=W, padding=True,
                    speculative="prompt-lookup")
    with drafting.open_sequence() as one, unpadded.open_sequence() as other:
        assert one.generate(prompt, 16, []) == other.generate(prompt, 16, [])
        assert one.stats.draft_tokens > 0


@pytest.mark.parametrize("name", ["genai-llama-fp32", "genai-gemma2-fp32"])
def test_native_chunks_on_the_device_path_with_the_capacity_mask(native_exports, monkeypatch,
                                                                 name):
    """The CPU marked not host-visible, as CUDA looks: the capacity-wide chunk mask written in
    place, query_seqlens in a device buffer, per-width sessions that return the one logits row
    asked for; padded tokens and the engine's equal the unpadded sequence's."""
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY, specialize=True)
    monkeypatch.setattr(facade, "resolve_device", lambda *args: device)
    path = native_exports[name]
    reference = load(path, provider="cpu", chunk_size=16, padding=False)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, reference.stats.vocab_size, n).tolist() for n in (5, 64, 37)]
    expected = []
    for prompt in prompts:
        with reference.open_sequence() as sequence:
            expected.append(sequence.generate(prompt, NEW_TOKENS, []))
    with load(path, chunk_size=16, max_batch=3) as device_runtime:
        windowed = any(port.window is not None for port in device_runtime.debug.ports.kv)
        assert device_runtime.stats.padding == ("native" if NATIVE else
                                                "off" if windowed else "repeat")
        assert device_runtime.generate_many(prompts, NEW_TOKENS, eos_token_id=[]) == expected
        for prompt, tokens in zip(prompts, expected):
            with device_runtime.open_sequence() as sequence:
                assert sequence.generate(prompt, NEW_TOKENS, []) == tokens
