"""Checks of public arguments at the edge, so the hot loop can trust them.

An integer argument is a Python int or a numpy integer: never a bool, a float (even 2.0) or a
string (even "64"). Pure functions, tested apart from ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnx_chunk.errors import InputError, OnnxChunkError


def integer(value: object, name: str, *, minimum: int | None = None,
            maximum: int | None = None,
            error: type[OnnxChunkError] = InputError) -> int:
    """`value` as an int when it is an integer within [minimum, maximum]; else `error`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{name} must be an integer, got {value!r} ({type(value).__name__}); "
                    "pass an int")
    number = int(value)
    if minimum is not None and number < minimum:
        raise error(f"{name} must be at least {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise error(f"{name} must be at most {maximum}, got {number}")
    return number


def optional_integer(value: object, name: str, *, minimum: int | None = None,
                     maximum: int | None = None,
                     error: type[OnnxChunkError] = InputError) -> int | None:
    """Like `integer`, with None passed through (meaning "the default")."""
    if value is None:
        return None
    return integer(value, name, minimum=minimum, maximum=maximum, error=error)


def token_ids(value: object, name: str, vocab_size: int) -> tuple[int, ...]:
    """One token id or a sequence of them, each in [0, vocab_size); InputError otherwise."""
    if isinstance(value, (str, bytes)):
        raise InputError(f"{name} must be a token id or a sequence of them, got {value!r}; "
                         "pass ints")
    if isinstance(value, np.ndarray):
        value = value.tolist() if value.ndim else value.item()
    items = value if isinstance(value, Sequence) else (value,)
    return tuple(integer(item, name, minimum=0, maximum=vocab_size - 1) for item in items)


def prompt_ids(value: object, vocab: int) -> np.ndarray:
    """A prompt's token ids as int64, checked: 1-D, not empty, integers in [0, vocab)
    (InputError). A copy: the caller may change its array after the check, and a queued
    request runs later."""
    ids = np.array(value)
    if ids.size == 0:
        raise InputError("the prompt is empty; pass at least one token id")
    if ids.ndim != 1:
        raise InputError(f"expected a 1-D sequence of token ids, got shape {list(ids.shape)}")
    if ids.dtype == np.bool_ or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"token ids must be integers, got dtype {ids.dtype}; convert them "
                         "with int() or numpy's astype(np.int64)")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise InputError(f"token id {int(ids[bad[0]])} at position {int(bad[0])} is outside "
                         f"the vocabulary [0, {vocab}); {bad.size} id(s) out of range")
    return ids.astype(np.int64, copy=False)


def stop_ids(eos_token_id: object, default: tuple[int, ...], vocab: int) -> tuple[int, ...]:
    """The EOS ids a generation stops at: `eos_token_id` checked (one id or several, each in
    [0, vocab)), or the model's own (`default`) when it is None."""
    if eos_token_id is None:
        return default
    return token_ids(eos_token_id, "eos_token_id", vocab)
