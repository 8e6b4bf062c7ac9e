"""The contract between the scheduler and the plan runner: what one step runs and what it gave.

`Scheduler.schedule()` returns a `Plan`: the rounds of prefill chunks, the drafts to verify and
the rows of the batched decode, each naming the `Running` request it serves. `PlanRunner.run`
runs every forward of a plan and returns `Outputs`: the logits each forward gave (with its
query width and seconds) and the forwards that failed. `Scheduler.update(plan, outputs)` turns
the outputs into tokens and returns the step's `StepResult`. (vLLM v1 draws the same line with
`SchedulerOutput` and `ModelRunnerOutput`, vllm/v1/core/sched/output.py and
vllm/v1/outputs.py; nano-vllm with the sequences its scheduler hands its model runner.)
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from onnx_chunk.runtime.engine.counters import ChunkRecord
from onnx_chunk.runtime.engine.kv_state import RowLength
from onnx_chunk.runtime.engine.request import Request
from onnx_chunk.runtime.engine.speculation import Drafter
from onnx_chunk.sampling import Sampler, TokenLogprobs


@dataclass(eq=False)
class Running:
    """A request in a slot: the slot's index, what its forwards run on (a `SequenceSlot`; a
    static request's `StaticSlot`) and its length, the request's sampler, its admission order,
    the prefill chunks ([begin, end) prompt rows) still to schedule, its last token, how many
    it produced and its drafter (speculative decoding)."""

    request: Request
    index: int
    slot: object
    length: RowLength
    sampler: Sampler
    order: int
    chunks: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    token: int = 0
    produced: int = 0
    drafter: Drafter | None = None


@dataclass(eq=False, slots=True)
class Chunk:
    """A prefill chunk to run: prompt rows [begin, end) of `row`'s request."""

    row: Running
    begin: int
    end: int

    @property
    def last(self) -> bool:
        """Whether it is its prompt's last chunk (its forward brings the last row's logits)."""
        return self.end == len(self.row.request.prompt)


@dataclass(slots=True)
class Plan:
    """One step's forwards, in the order they run: `rounds` of prefill chunks (each prompt's
    picked chunks, one per round), `drafts` (a row feeding its last token and its draft in a
    verification forward of its own), `decoding` (the rows of the batched decode, their prompts
    fed before this step). `running`: the requests in slots when it was made (0: an idle
    step, nothing to run); `stalls`: rows decode while prompts prefill, so the decodes wait
    for the chunks (`EngineStats.decode_stalls`)."""

    rounds: list[list[Chunk]] = field(default_factory=list)
    drafts: list[tuple[Running, np.ndarray]] = field(default_factory=list)
    decoding: list[Running] = field(default_factory=list)
    running: int = 0
    stalls: bool = False


@dataclass(slots=True)
class Prefilled:
    """A prefill chunk that ran at query width `width`: its last row's logits [vocab] (None
    before a prompt's last chunk unless its prompt logprobs were asked for) and the entries of
    the prompt tokens it predicted, when asked for (reduced from every row's logits as soon as
    the forward ran, so a step holds no chunk's [rows, vocab])."""

    chunk: Chunk
    width: int
    seconds: float
    logits: np.ndarray | None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def record(self) -> ChunkRecord:
        return ChunkRecord(self.chunk.end - self.chunk.begin, self.width, self.seconds)


@dataclass(slots=True)
class Verified:
    """A verification forward that ran: `row` fed its last token and `draft`; every fed row's
    logits [len(draft) + 1, vocab]."""

    row: Running
    draft: np.ndarray
    logits: np.ndarray
    seconds: float


@dataclass(slots=True)
class Outputs:
    """What a plan's forwards gave: each prefill chunk and verification that ran, the rows of
    the batched decode with its logits (indexed by slot) and time, whether a batched decode
    was tried (`decode_ran`), and each row whose forward failed, with the exception (its
    later forwards in the plan were left out)."""

    prefilled: list[Prefilled] = field(default_factory=list)
    verified: list[Verified] = field(default_factory=list)
    decoded: list[Running] = field(default_factory=list)
    decode_logits: np.ndarray | tuple[np.ndarray] | None = None
    decode_s: float = 0.0
    decoded_at: float = 0.0
    decode_ran: bool = False
    failed: list[tuple[Running, BaseException]] = field(default_factory=list)

    def live(self, row: Running) -> bool:
        """Whether `row` still runs: its request has not ended and no forward of it failed."""
        return not row.request.done and all(row is not failed for failed, _ in self.failed)


class StepResult(NamedTuple):
    """What one `step()` ran.

    `chunks`: its prefill forwards, one record per prompt chunk (real rows, query width,
    seconds); `decode_rows`: the rows that decoded in its batched decode forward (0: none ran);
    `verifications`: its draft verification forwards, `drafted` / `accepted` the tokens they
    verified and kept; `decode_s`: the time of its decode and verification forwards;
    `finished`: the requests that ended in it (finished or failed).
    """

    chunks: tuple[ChunkRecord, ...] = ()
    decode_rows: int = 0
    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    decode_s: float = 0.0
    finished: tuple[Request, ...] = ()

    @property
    def ran(self) -> bool:
        """Whether the step ran any forward."""
        return bool(self.chunks) or self.decode_rows > 0 or self.verifications > 0
