"""The slots an engine runs its requests in, and what a slot keeps after one: a slot policy.

The scheduler admits requests into slots and frees them; what a slot is made of and what it
keeps is its policy's:
- `EngineSlots`, the runtime's engine: `slots` rows of one `BatchBuffers` (one allocation per
  KV port, the batched decode's slot over all of them), each keeping the ids it was fed for
  the next request (prefix reuse, `prefix_reuse`); a request's other choices are forked into
  free slots by a device copy of its slot's rows.
- `CallerSlot`, a lone engine's: one slot owned by its caller (a sequence's own buffers and
  logical length; a static request's cache and length). Its request continues the slot at its
  length and leaves the length where it ended: nothing is reset, kept or rewound (the caller
  rolls a failed request back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from onnx_chunk.errors import InputError
from onnx_chunk.runtime.device.buffers import BatchBuffers
from onnx_chunk.runtime.engine.kv_state import LogicalLength, RowLength
from onnx_chunk.runtime.engine.prefix_reuse import KeptPrefix, PrefixRule, SlotChoice, choose_slot
from onnx_chunk.runtime.engine.request import Request
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot
from onnx_chunk.sampling import Sampling

_NO_IDS = np.zeros(0, dtype=np.int64)


class SlotPolicy(Protocol):
    """What a scheduler asks of its slots (see the module docstring).

    `slots`, `lengths`: what each slot's forwards run on and its length; `batch`: the slot of
    every row (the batched forwards').
    """

    @property
    def slots(self) -> Sequence[object]: ...

    @property
    def lengths(self) -> Sequence[RowLength]: ...

    @property
    def batch(self) -> object: ...

    def choose(self, free: list[int], prompt: np.ndarray, sampling: Sampling) -> SlotChoice:
        """The free slot an arriving request takes, and the prefix it reuses."""
        ...

    def start(self, choice: SlotChoice) -> None:
        """Make the chosen slot hold the reused prefix (nothing: an empty sequence)."""
        ...

    def keep(self, index: int, request: Request, salt: str | None) -> None:
        """What the slot of an ended request (of cache salt `salt`) keeps for the next one."""
        ...

    def drop(self, index: int) -> None:
        """The slot keeps nothing (a failure while starting or forking into it)."""
        ...

    def fork(self, source: int, index: int) -> None:
        """Make free slot `index` hold what slot `source` holds (another choice of its
        prompt)."""
        ...

    def close(self) -> None:
        """Give back what the slots hang off (their graph slot numbers)."""
        ...


class EngineSlots:
    """The runtime engine's slots (see the module docstring): `rule` says which kept prefixes
    a slot can be rewound to (`prefix_reuse`); `give_number` gives a graph slot number back."""

    def __init__(self, slots: list[SequenceSlot], batch: SequenceSlot, buffers: BatchBuffers,
                 capacity: int, rule: PrefixRule, give_number: Callable[[int], None]) -> None:
        self.slots = slots
        self.batch = batch
        self.lengths = [LogicalLength(capacity) for _ in slots]
        self._buffers = buffers
        self._rule = rule
        self._give_number = give_number
        self._kept = [KeptPrefix(_NO_IDS)] * len(slots)
        self._released = 0

    def choose(self, free: list[int], prompt: np.ndarray, sampling: Sampling) -> SlotChoice:
        """By `choose_slot`. A request for its prompt's logprobs needs every prompt row's
        logits: it reuses no kept prefix (it still takes the slot the rule would pick
        otherwise)."""
        rule = (self._rule if sampling.prompt_logprobs is None
                else dataclasses.replace(self._rule, enabled=False))
        return choose_slot({index: self._kept[index] for index in free}, prompt, rule,
                           sampling.cache_salt)

    def start(self, choice: SlotChoice) -> None:
        """Rewind the chosen slot to the prefix it reuses (an empty slot: reset it)."""
        length = self.lengths[choice.slot]
        if choice.reused == 0:
            self.slots[choice.slot].reset()
        length.rewind(length.length - choice.reused)

    def keep(self, index: int, request: Request, salt: str | None) -> None:
        """The ids fed to the slot (the prompt, then the generated tokens, up to its length;
        in exact mode the prompt's); nothing after a failure or with reuse off."""
        length = self.lengths[index].length
        fed = np.concatenate([request.prompt, np.asarray(request.produced, dtype=np.int64)])
        if (not self._rule.enabled or request.finish_reason == "error"
                or len(fed) < length):
            self.drop(index)
            return
        self._released += 1
        self._kept[index] = KeptPrefix(fed[:self._rule.kept(len(request.prompt), length)],
                                       self._released, salt)

    def drop(self, index: int) -> None:
        """The slot keeps nothing: its next request starts it empty."""
        self._kept[index] = KeptPrefix(_NO_IDS)
        self.lengths[index].rewind(self.lengths[index].length)

    def fork(self, source: int, index: int) -> None:
        """A device copy of slot `source`'s KV and state rows into slot `index`, whose own
        length (the batched decode runs every slot at its length) becomes the source's."""
        self.slots[index].reset()
        self._buffers.copy_slot(source, index)
        length = self.lengths[index]
        length.rewind(length.length)
        length.advance(self.lengths[source].length)

    def close(self) -> None:
        for slot in (*self.slots, self.batch):
            self._give_number(slot.number)


class CallerSlot:
    """A lone engine's one slot, owned by its caller (see the module docstring)."""

    def __init__(self, slot: object, length: RowLength) -> None:
        self.slots = [slot]
        self.lengths = [length]
        self.batch = slot

    def choose(self, free: list[int], prompt: np.ndarray, sampling: Sampling) -> SlotChoice:
        """The one slot, continued where the sequence is."""
        return SlotChoice(free[0], 0, 0)

    def start(self, choice: SlotChoice) -> None:
        """The request continues the sequence where it is."""

    def keep(self, index: int, request: Request, salt: str | None) -> None:
        """The slot holds what its sequence was fed; its length stays where the request left
        it."""

    def drop(self, index: int) -> None:
        """The sequence keeps its length (its caller rolls a failure back)."""

    def fork(self, source: int, index: int) -> None:
        raise InputError("a sequence runs one choice of a prompt; submit choices to the "
                         "runtime (Runtime.submit_choices)")

    def close(self) -> None:
        """The caller gives its slot back to its pool."""
