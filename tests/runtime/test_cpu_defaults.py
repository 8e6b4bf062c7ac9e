"""The CPU default (one shape-generic session owning its weights), weights accounting and the
decode loop's pinned variant."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from onnx_chunk.runtime import load
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for

PROMPT = np.random.default_rng(11).integers(0, 256, 37).tolist()


def test_cpu_defaults_to_one_session_that_owns_its_weights(reference_model):
    runtime = load(reference_model(), provider="cpu", capacity=96, chunk_size=16)
    tokens = runtime.open_sequence().generate(PROMPT, 6)
    stats = runtime.stats
    assert stats.specialize is False and runtime.debug.options.decode_key is None
    assert stats.padding == "off" and "shape-generic" in stats.cache.padding_refused
    assert stats.cache.widths == ("dynamic",) and stats.sessions_created == 1
    assert stats.weights_shared is False and runtime.debug.weights.names == ()
    assert stats.weights_bytes == sum(p.stat().st_size for p in
                                      reference_model().parent.glob("*.data"))
    variants = load(reference_model(), provider="cpu", capacity=96, chunk_size=16,
                    specialize=True, padding=False)
    assert variants.open_sequence().generate(PROMPT, 6) == tokens


def test_padding_in_the_shape_generic_mode_follows_the_caller_and_the_plan(
        reference_model, monkeypatch):
    path = reference_model()
    def padding(**options) -> str:
        return load(path, provider="cpu", capacity=96, chunk_size=16, **options).stats.padding

    assert padding(padding=True) != "off"
    monkeypatch.setenv("ONNX_CHUNK_PREFILL_QUERY_PADDING", "1")
    assert padding() != "off"
    monkeypatch.setenv("ONNX_CHUNK_PREFILL_QUERY_PADDING", "0")
    assert padding(specialize=True) == "off"
    monkeypatch.delenv("ONNX_CHUNK_PREFILL_QUERY_PADDING")
    refused = load(reference_model("conv_hybrid"), provider="cpu", capacity=96, chunk_size=16,
                   padding=True)
    assert refused.stats.padding == "off"
    assert refused.stats.cache.padding_refused.startswith("refused by the model")


def _resident_bytes_of(path):
    """Resident bytes of every mapping of `path` in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_shared_weights_are_resident_from_load(reference_model):
    path = reference_model()
    data = next(path.parent.glob("*.data")).resolve()
    runtime = load(path, provider="cpu", capacity=96, chunk_size=16, specialize=True)
    stats = runtime.stats
    assert stats.weights_shared and stats.weights_bytes == runtime.debug.weights.nbytes > 0
    # Faulted in at load (so no variant's build reading takes them in), and read there (the
    # reading is the process's, so memory other code frees meanwhile can lower it).
    assert _resident_bytes_of(data) >= runtime.debug.weights.nbytes
    assert isinstance(stats.weights_resident_bytes, int)
    assert stats.cache.compiles == 0 and stats.cache.bytes_held == 0


def test_generate_pins_the_decode_variant_once(reference_model):
    runtime = load(reference_model(), provider="cpu", capacity=96, chunk_size=16,
                   specialize=True)
    runtime.open_sequence().generate(PROMPT, 2)  # builds every variant the prompt needs
    before = runtime.stats.cache
    generated = runtime.open_sequence().generate(PROMPT, 9)
    after = runtime.stats.cache
    prefill_forwards = 3  # 37 rows at width 16: 16, 16, 5
    assert after.hits - before.hits == prefill_forwards + 1
    assert after.compiles == before.compiles
    stepped = runtime.open_sequence()
    tokens = [int(np.argmax(stepped.prefill(PROMPT)))]
    for _ in range(8):
        tokens.append(int(np.argmax(stepped.decode(tokens[-1]))))
    assert tokens == generated
    assert runtime.stats.cache.hits - after.hits == prefill_forwards + 8


def test_an_abandoned_stream_releases_its_decode_variant(reference_model):
    runtime = load(reference_model(), provider="cpu", capacity=96, chunk_size=16,
                   specialize=True, max_variants=2, padding=False)
    stream = runtime.open_sequence().stream(PROMPT[:4], 5)
    next(stream), next(stream)  # the decode variant is pinned now
    stream.close()
    # No pin left: every variant, the decode one included, can be released now.
    assert runtime.stats.cache.variants == 2
    assert runtime.debug.cache.clear() == 2 and runtime.stats.cache.variants == 0
    runtime.open_sequence().generate(PROMPT, 3)  # needs both slots: 16 and dynamic, then 1
    assert runtime.stats.cache.peak_variants <= 2


def test_first_run_growth_is_charged_off_the_host(reference_model):
    device = dataclasses.replace(device_for("cpu"), host_visible=False,
                                 mask_policy=MaskPolicy.CAPACITY, specialize=True)
    runtime = load(reference_model(), device=device, capacity=96, chunk_size=16)
    runtime.open_sequence().generate(PROMPT, 3)
    runtime.open_sequence().generate(PROMPT, 3)
    cache = runtime.stats.cache
    assert cache.growth_readings == cache.compiles  # each variant's first run, once
    assert cache.bytes_held == sum(cache.variant_bytes.values())
    host = load(reference_model(), provider="cpu", capacity=96, chunk_size=16, specialize=True)
    host.open_sequence().generate(PROMPT, 3)
    assert host.stats.cache.growth_readings == 0
