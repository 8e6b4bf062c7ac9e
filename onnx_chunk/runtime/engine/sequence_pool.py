"""Sequence slots: the device buffers of a sequence, pooled with the CUDA graphs that use them.

A captured CUDA graph replays the addresses it recorded: the KV, state and mask buffers of one
sequence and that sequence's token, position and logits buffers. A server opens a sequence per
request; if each new sequence brought new buffers, it would capture every width again (two
warm-up runs and a capture per width) and the old graphs would stay until their variant is
evicted. So the buffers of a closed sequence go back to a pool, with the graph slot number
their bindings run under, and the next sequence takes them: its forwards replay the graphs the
previous one captured. Pooling was chosen over releasing the graphs at every close because a
release buys nothing a reuse does not (the next request captures the same graphs again) and
costs the capture each time.

Rules:
1. `take` hands out an idle slot (the most recently returned, whose graphs are warm) or makes a
   new one with the smallest free slot number. The CUDA provider keeps its graphs per thread,
   so an idle slot last taken by this thread comes first, and a slot taken by another thread
   is claimed for it (`claim`: its bindings and graph ids kept, each id's next run there a
   capture), since a graph the provider cannot free would otherwise be stranded.
2. `give_back` only queues the slot: it may run from a garbage-collector finalizer at any
   moment, even while the same thread holds a capture, so it does no device work and takes no
   lock. Queued slots are settled at the next `take`, `settle` or `close`.
3. At most `keep` slots stay idle; settling frees the rest (`free`: their graphs are released
   and their buffers dropped).
4. After `close` nothing is handed out (ClosedError) and returned slots are dropped.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from onnx_chunk.errors import ClosedError, ConfigError
from onnx_chunk.runtime.caches.cuda_graphs import SlotNumbers
from onnx_chunk.runtime.device.buffers import SequenceBuffers, SlotBuffers
from onnx_chunk.runtime.device.provider import Device
from onnx_chunk.runtime.runner.attention_mask import AttentionMask
from onnx_chunk.runtime.state.ports import ModelPorts

logger = logging.getLogger(__name__)

DEFAULT_IDLE_SLOTS = 4


@dataclass
class SequenceSlot:
    """One sequence's device buffers and the graph slot number its bindings run under.

    `captures`: whether its bindings may capture CUDA graphs (a row of the batch engine never
    does: its state buffers are the batch's, whose parity the engine's decode flips, and its
    thread may change between steps).
    """

    number: int
    buffers: SequenceBuffers | SlotBuffers
    mask: AttentionMask
    captures: bool = True
    thread: int = 0

    def reset(self) -> None:
        """Make the buffers those of an empty sequence (KV past the length is never read)."""
        self.mask.reset()
        if self.buffers.state_ports:
            self.buffers.reset_state()


def new_slot(ports: ModelPorts, capacity: int, device: Device, masks: type[AttentionMask],
             number: int, *, buffers: SlotBuffers | None = None,
             captures: bool = True) -> SequenceSlot:
    """A slot for a sequence of `capacity` positions on `device`: fresh buffers, or `buffers`
    (a row of the batch engine's), and a mask of the runtime's policy (`masks`)."""
    if buffers is None:
        buffers = SequenceBuffers(ports.kv, ports.state, device)
    return SequenceSlot(number, buffers, masks(1, capacity, ports.mask_dtype, device),
                        captures=captures)


@dataclass
class PoolStats:
    """Slots made, handed out again from the pool, freed, and idle now."""

    created: int = 0
    reused: int = 0
    freed: int = 0
    idle: int = 0


class SequencePool:
    """Idle sequence slots, handed out again; see the module docstring for the rules."""

    def __init__(self, make: Callable[[int], SequenceSlot],
                 free: Callable[[int], None], keep: int = DEFAULT_IDLE_SLOTS,
                 claim: Callable[[int], None] | None = None) -> None:
        if keep < 0:
            raise ConfigError(f"the number of idle sequences kept must be at least 0, got {keep}")
        self._make = make
        self._free = free
        self._claim = free if claim is None else claim
        self.keep = keep
        self._numbers = SlotNumbers()
        self._returned: collections.deque[SequenceSlot] = collections.deque()
        self._idle: list[SequenceSlot] = []
        self._lock = threading.Lock()
        self._closed = False
        self._stats = PoolStats()

    def take(self) -> SequenceSlot:
        """A slot for a new sequence: an idle one reset, else a new one."""
        self.settle()
        with self._lock:
            if self._closed:
                raise ClosedError("the runtime was closed; load the model again to open "
                                  "sequences")
            thread = threading.get_ident()
            mine = [index for index, idle in enumerate(self._idle) if idle.thread == thread]
            slot = self._idle.pop(mine[-1] if mine else -1) if self._idle else None
            if slot is not None:
                self._stats.reused += 1
        if slot is not None:
            if slot.thread != thread:
                self._claim(slot.number)
            slot.thread = thread
            slot.reset()
            return slot
        slot = self._make(self._numbers.take())
        slot.thread = thread
        with self._lock:
            self._stats.created += 1
        return slot

    def give_back(self, slot: SequenceSlot) -> None:
        """Queue the slot of a closed (or collected) sequence; safe from a finalizer."""
        if not self._closed:
            self._returned.append(slot)

    def settle(self) -> None:
        """Move queued slots to the idle list and free those beyond `keep`."""
        surplus: list[SequenceSlot] = []
        with self._lock:
            while self._returned:
                self._idle.append(self._returned.popleft())
            limit = 0 if self._closed else self.keep
            while len(self._idle) > limit:
                surplus.append(self._idle.pop(0))
        for slot in surplus:
            self._release(slot)

    def close(self) -> None:
        """Free every idle slot; hand out none from now on."""
        with self._lock:
            self._closed = True
        self.settle()

    def take_number(self) -> int:
        """A graph slot number for buffers the pool does not hold (the batch engine's rows)."""
        return self._numbers.take()

    def give_number(self, number: int) -> None:
        """Drop what hangs off `number` (its bindings and graphs) and let it be taken again."""
        self._free(number)
        self._numbers.give(number)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self._stats.created, self._stats.reused, self._stats.freed,
                             len(self._idle))

    def _release(self, slot: SequenceSlot) -> None:
        self._free(slot.number)
        self._numbers.give(slot.number)
        with self._lock:
            self._stats.freed += 1
        logger.debug("freed sequence slot %d", slot.number)
