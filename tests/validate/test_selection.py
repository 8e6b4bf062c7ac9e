"""Check names, --skip selection and the prompt lengths around chunk boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_chunk.errors import ConfigError
from onnx_chunk.validate.checks import CHECKS, all_names, resolve_skip
from onnx_chunk.validate.prompts import boundary_lengths, seeded_prompt
from onnx_chunk.validate.validator import ValidationOptions


def test_skip_takes_groups_full_names_and_bare_names():
    assert resolve_skip(["numerics"]) == {f"numerics.{name}" for name in CHECKS["numerics"]}
    assert resolve_skip(["structure.ladder", "second_pass"]) == {"structure.ladder",
                                                                  "cache.second_pass"}
    assert resolve_skip([]) == frozenset()
    assert len(all_names()) == sum(len(checks) for checks in CHECKS.values())


def test_unknown_skip_names_the_valid_ones():
    with pytest.raises(ConfigError, match="names no check.*structure, numerics"):
        resolve_skip(["numeric"])


@pytest.mark.parametrize("chunk, longest, expected", [
    (8, 100, (1, 7, 8, 9, 19)),
    (512, 2044, (1, 511, 512, 513, 1195)),
    (8, 12, (1, 7, 8, 9, 12)),
    (1, 100, (1, 2, 3)),
    (2, 1, (1,)),
])
def test_boundary_lengths(chunk, longest, expected):
    assert boundary_lengths(chunk, longest) == expected


def test_boundary_lengths_need_room():
    with pytest.raises(ConfigError, match="no prompt fits"):
        boundary_lengths(8, 0)


def test_seeded_prompts_are_reproducible_and_in_the_vocabulary():
    first = seeded_prompt(256, 40, seed=3)
    assert first.dtype == np.int64 and first.shape == (40,)
    assert 0 <= first.min() and first.max() < 256
    assert np.array_equal(first, seeded_prompt(256, 40, seed=3))
    assert not np.array_equal(first, seeded_prompt(256, 40, seed=4))
    assert not np.array_equal(first[:39], seeded_prompt(256, 39, seed=3))


@pytest.mark.parametrize("options, message", [
    (dict(new_tokens=0), "new tokens"),
    (dict(lengths=(4, 0)), "lengths"),
    (dict(lengths=()), "lengths"),
    (dict(atol=-1.0), "atol"),
    (dict(atol=float("nan")), "atol"),
    (dict(provider="tpu"), "provider"),
    (dict(chunk_size=0), "chunk size"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(new_tokens=2.0), "new tokens"),
    (dict(new_tokens="4"), "new tokens"),
    (dict(lengths=(4, 2.5)), "lengths"),
    (dict(chunk_size=True), "chunk size"),
    (dict(max_input_len=0), "max_input_len"),
    (dict(atol="0"), "atol"),
])
def test_options_are_checked_once_at_the_edge(options, message):
    with pytest.raises(ConfigError, match=message):
        ValidationOptions(**options)
