"""genai_config.json beside a decoder gives the runtime its defaults; folders load as in genai."""

from __future__ import annotations

import json

import pytest

from onnx_chunk.errors import CapacityError, ConfigError, ModelLoadError
from onnx_chunk.runtime import load
from tests.validate.mutations import copy_model


def _edit_config(model, change) -> None:
    path = model.parent / "genai_config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


@pytest.fixture
def model(reference_model, tmp_path):
    return copy_model(reference_model("base"), tmp_path / "model")


def test_a_folder_loads_the_decoder_its_config_names(model):
    (model.parent / "model.onnx").rename(model.parent / "decoder.onnx")
    _edit_config(model, lambda config: config["model"]["decoder"].update(filename="decoder.onnx"))
    runtime = load(model.parent, provider="cpu", capacity=64)
    assert runtime.debug.model_path == model.parent / "decoder.onnx"
    file_runtime = load(model.parent / "decoder.onnx", provider="cpu", capacity=64)
    prompt = list(range(3, 30))
    assert (runtime.open_sequence().generate(prompt, 4, eos_token_id=[])
            == file_runtime.open_sequence().generate(prompt, 4, eos_token_id=[]))


def test_context_length_caps_the_capacity_and_a_request_past_it_names_the_numbers(model):
    def shrink(config):
        config["model"]["context_length"] = 256
        config["search"]["max_length"] = 4096

    _edit_config(model, shrink)
    runtime = load(model, provider="cpu")
    assert runtime.stats.capacity == 256
    with pytest.raises(CapacityError, match="300 new tokens.*256"):
        runtime.open_sequence().generate([5, 6, 7], 300)
    with pytest.raises(ConfigError, match="context_length 256"):
        load(model, provider="cpu", capacity=300)


def test_search_max_length_is_the_default_capacity_and_an_argument_overrides_it(model):
    _edit_config(model, lambda config: config["search"].update(max_length=96))
    assert load(model, provider="cpu").stats.capacity == 96
    assert load(model, provider="cpu", capacity=128).stats.capacity == 128


def test_a_list_of_eos_ids_is_the_default_stop(model):
    runtime = load(model, provider="cpu", capacity=128)
    prompt = list(range(3, 40))
    free = runtime.open_sequence().generate(prompt, 12, eos_token_id=[])
    stop_at = free[3]
    first = free.index(stop_at)
    _edit_config(model, lambda config: config["model"].update(eos_token_id=[250, stop_at]))
    runtime = load(model, provider="cpu", capacity=128)
    assert runtime.stats.eos_token_ids == (250, stop_at)
    assert runtime.open_sequence().generate(prompt, 12) == free[:first + 1]


def test_an_eos_id_outside_the_vocabulary_is_refused_at_load(model):
    _edit_config(model, lambda config: config["model"].update(eos_token_id=[2, 10**6]))
    with pytest.raises(ModelLoadError, match="1000000"):
        load(model, provider="cpu", capacity=64)


def test_a_config_beside_another_decoder_does_not_apply(model):
    (model.parent / "model.onnx").rename(model.parent / "b.onnx")
    _edit_config(model, lambda config: config["model"].update(context_length=64))
    runtime = load(model.parent / "b.onnx", provider="cpu", capacity=128)
    assert runtime.debug.genai is None and runtime.stats.capacity == 128
