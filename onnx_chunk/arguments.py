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
