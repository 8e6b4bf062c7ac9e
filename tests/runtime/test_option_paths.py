"""A `RuntimeOptions` field goes one way from `load` to where it is used: along every chain of
calls that pass its value on, no module is entered again after the chain has left it (no
facade -> engine -> facade round trips). Traced with `sys.setprofile` on a real load and
request: a call holds the value when an argument is it (or a dataclass argument's field of
that name is); each chain runs from the module that called its first holder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import onnx_chunk
from onnx_chunk.runtime import load

PACKAGE = Path(onnx_chunk.__file__).parent
_VARARGS, _VARKEYWORDS = 0x04, 0x08


def _holds(frame, name: str, value: int) -> bool:
    code = frame.f_code
    count = (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & _VARARGS)
             + bool(code.co_flags & _VARKEYWORDS))
    given = [frame.f_locals.get(arg) for arg in code.co_varnames[:count]]
    given += [item for each in given if type(each) is dict for item in each.values()]
    return any((type(each) is int and each == value)
               or (name in getattr(type(each), "__dataclass_fields__", {})
                   and getattr(each, name) == value) for each in given)


def _chains(name: str, value: int, run) -> list[list[str]]:
    """The module chains (consecutive repeats merged) of every call holding the value."""
    stack: list[tuple[str | None, bool]] = []
    chains = []

    def profile(frame, event, _):
        if event == "call":
            file = Path(frame.f_code.co_filename)
            inside = file.is_relative_to(PACKAGE)
            module = file.relative_to(PACKAGE).as_posix() if inside else None
            holds = inside and _holds(frame, name, value)
            stack.append((module, holds))
            if holds:
                first = next(index for index, (_, held) in enumerate(stack) if held)
                caller = stack[first - 1][0] if first else None
                modules = [caller] if caller else []
                for each, held in stack[first:]:
                    if held and (not modules or modules[-1] != each):
                        modules.append(each)
                chains.append(modules)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return chains


@pytest.mark.parametrize("name, value, reaches", [
    ("max_batch", 37, {"runtime/device/buffers.py", "runtime/caches/graph_cache.py"}),
    ("max_queue", 41, {"runtime/engine/request_queue.py"}),
    ("idle_sequences", 13, {"runtime/engine/sequence_pool.py"}),
    ("capacity", 72, {"runtime/engine/kv_state.py", "runtime/runner/attention_mask.py"}),
    ("chunk_size", 24, {"runtime/engine/scheduler.py", "ladder.py"}),
    ("max_variants", 6, {"runtime/caches/variant_cache.py"}),
])
def test_an_option_goes_from_load_to_its_use_one_way(reference_model, name, value, reaches):
    path = reference_model()

    def run():
        options = {"provider": "cpu", "capacity": 64, "chunk_size": 16, name: value}
        with load(path, **options) as runtime:
            runtime.submit([1, 2, 3], 2).result()

    chains = _chains(name, value, run)
    assert reaches <= {module for chain in chains for module in chain}
    assert all(chain[0] == "runtime/facade.py" for chain in chains if reaches & set(chain))
    back = [chain for chain in chains if len(set(chain)) != len(chain)]
    assert not back, f"{name} returns to a module it has left: {back}"
