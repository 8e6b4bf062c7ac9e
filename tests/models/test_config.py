import dataclasses

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.models import PRESETS, config_for, decoder_config, make_weights
from onnx_chunk.models.weights import AttentionWeights, ConvWeights


def test_presets_are_valid_and_bench_is_about_100m_parameters():
    for config in PRESETS.values():
        assert config.validate() is config
    assert 80e6 < PRESETS["bench"].parameter_count() < 130e6
    tiny = PRESETS["tiny"]
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads,
            tiny.head_size, tiny.vocab_size, tiny.max_positions) == (2, 64, 4, 2, 16, 256, 2048)


@pytest.mark.parametrize("overrides, fragment", [
    ({"num_heads": 4, "num_kv_heads": 3, "head_size": 16}, "must divide"),
    ({"num_layers": 0}, "num_layers"),
    ({"hidden_size": -8}, "hidden_size"),
    ({"head_size": 15}, "even"),
    ({"vocab_size": 2}, "eos_token_id"),
    ({"conv_layers": (0, 1)}, "attention layer"),
    ({"conv_layers": (5,)}, "conv_layers"),
    ({"rope_theta": 0.0}, "rope_theta"),
])
def test_impossible_sizes_raise_config_error(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        config_for("tiny", **overrides)


def test_unknown_preset_and_override_name_the_choices():
    with pytest.raises(ConfigError, match="tiny"):
        config_for("huge")
    with pytest.raises(ConfigError, match="num_layers"):
        config_for("tiny", layers=3)


def test_head_size_follows_hidden_and_heads():
    assert config_for("tiny", hidden_size=128).head_size == 32
    assert config_for("tiny", num_heads=8, num_kv_heads=4).head_size == 8
    assert config_for("tiny", hidden_size=128, head_size=16).head_size == 16


def test_conv_hybrid_makes_even_layers_conv():
    assert decoder_config("tiny", "conv_hybrid").conv_layers == (0,)
    assert decoder_config("tiny", "conv_hybrid", num_layers=5).conv_layers == (0, 2, 4)
    assert decoder_config("tiny", "conv_hybrid", num_layers=5).attention_layers == (1, 3)


def test_weights_are_seeded_shaped_and_counted():
    config = config_for("tiny", num_layers=3, conv_layers=(1,))
    first, again, other = make_weights(config, 3), make_weights(config, 3), make_weights(config, 4)

    def arrays(w):
        return [w.embedding, w.final_norm, w.lm_head] + [
            a for layer in w.layers for a in dataclasses.astuple(layer)
            if isinstance(a, np.ndarray)] + [a for layer in w.layers
                                              for a in dataclasses.astuple(layer.mixer)]

    assert all(np.array_equal(a, b) for a, b in zip(arrays(first), arrays(again)))
    assert not np.array_equal(first.lm_head, other.lm_head)
    assert all(a.dtype == np.float32 for a in arrays(first))
    assert isinstance(first.layers[1].mixer, ConvWeights)
    assert isinstance(first.layers[0].mixer, AttentionWeights)
    assert first.layers[0].mixer.k_proj.shape == (64, 2 * 16)
    assert first.layers[1].mixer.kernel.shape == (64, config.conv_kernel)
    assert sum(a.size for a in arrays(first)) == config.parameter_count()
