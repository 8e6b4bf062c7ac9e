"""What the runner reads of a sequence's slot and logical length, as Protocols.

The runner runs forwards over buffers the engine layer owns (`engine.sequence_pool.
SequenceSlot`, `engine.kv_state.LogicalLength`); naming them here by what the runner uses keeps
the imports one way (runner <- engine), as the import-layer test (tests/runtime/test_layers.py)
checks.
"""

from __future__ import annotations

from typing import Protocol

from onnx_chunk.runtime.device.buffers import SequenceBuffers, SlotBuffers
from onnx_chunk.runtime.runner.attention_mask import AttentionMask


class Length(Protocol):
    """A sequence's logical length within its KV capacity (engine.kv_state.LogicalLength)."""

    length: int

    @property
    def room(self) -> int: ...

    def end(self, width: int) -> int: ...

    def advance(self, rows: int) -> None: ...


class Slot(Protocol):
    """A sequence's device buffers, mask and graph slot number (engine.sequence_pool.
    SequenceSlot)."""

    number: int
    buffers: SequenceBuffers | SlotBuffers
    mask: AttentionMask
    captures: bool
    thread: int
