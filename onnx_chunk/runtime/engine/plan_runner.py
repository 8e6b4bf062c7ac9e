"""The plan runner: every forward of a step's `Plan` through the model runner, `Outputs` back.

Rules:
1. The forwards run in the plan's order: each round of prefill chunks, then each draft's
   verification, then the batched decode.
2. A round's chunks run as one forward [slots, S] over the engine's buffers (idle slots at
   query_seqlens 0, S the widest chunk's padded width) when the runner batches chunks
   natively and that computes no more rows (`scheduler.batch_pays`); a chunk of a request for
   its prompt's logprobs (it needs every row's logits) runs alone, as does every chunk
   otherwise: one forward of its own slot, on a row of the engine's buffers with the ladder
   padding and variant cache of any sequence. A batched forward that finds no room for the
   padded width near a slot's capacity (CapacityError) runs its chunks apart.
3. Only a prompt's last chunk brings logits back (its last row's), except for a request for
   its prompt's logprobs: every row's, reduced at once to the prompt tokens' entries.
4. A verification runs in a forward of its row's slot: its last token and the draft, every
   row's logits.
5. The batched decode is one forward of every slot: each decoding row feeds its last token,
   every other row runs but is left as it was (natively at query_seqlens 0, which leaves its
   cache untouched; else `idle_rows`); a free slot runs at its kept length, so its write lands
   past what it keeps. With a pinned decode step (`decode`, a lone sequence's decode variant)
   the one decoding row feeds it instead.
6. A forward that fails is recorded with its rows (`Outputs.failed`) and nothing else changes:
   the other forwards run; a row that failed, or whose request ended meanwhile (a cancel), is
   left out of the forwards after. The scheduler fails the requests (`Scheduler.update`).
7. The CUDA provider keeps its graphs per thread, so a forward on the batch's bindings in
   another thread than the last one's drops the graphs captured there first
   (`release_graphs`; None: a lone sequence's slot, which its pool claims for its thread and
   which runs no batched forward).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from onnx_chunk.errors import CapacityError
from onnx_chunk.runtime.engine.kv_state import RowLength
from onnx_chunk.runtime.engine.plan import Chunk, Outputs, Plan, Prefilled, Running, Verified
from onnx_chunk.runtime.engine.scheduler import batch_pays
from onnx_chunk.runtime.engine.sequence_pool import SequenceSlot
from onnx_chunk.runtime.runner.forward import Forward, LogitsRows, Ran, Row
from onnx_chunk.sampling import TokenLogprobs, prompt_logprobs_of


class Forwards(Protocol):
    """What a plan's forwards run on: a dynamic decoder's `ModelRunner`, or a static request's
    graphs (`onnx_chunk.static.runner`), each taking its own kind of slot."""

    @property
    def batches_chunks(self) -> bool:
        """Whether one forward may run several slots' chunks (native chunks, rule 2)."""
        ...

    def chunk_width(self, rows: int, room: int) -> int:
        """The query width a chunk of `rows` real rows runs at with `room` positions left."""
        ...

    def run(self, slot: Any, forward: Forward) -> Ran: ...


class PlanRunner:
    """Runs plans on one set of slots (see the module docstring).

    `batch`: the slot of every row (the batched forwards'); `lengths`: each slot's logical
    length (an idle row runs at its own); `release_graphs(number)`: drop the graphs held
    under a slot number (rule 7). `decode`: a pinned decode step, set by its owner (rule 5).
    """

    def __init__(self, runner: Forwards, batch: object, lengths: Sequence[RowLength],
                 release_graphs: Callable[[int], None] | None) -> None:
        self._runner = runner
        self._batch = batch
        self._lengths = lengths
        self._release_graphs = release_graphs
        self.slots = len(lengths)
        self.decode: Callable[[int], np.ndarray] | None = None

    @property
    def batches_chunks(self) -> bool:
        """Whether a round's chunks may run in one forward (native chunks)."""
        return self._runner.batches_chunks

    def run(self, plan: Plan) -> Outputs:
        """Every forward of `plan`, in order (rule 1); what they gave."""
        outputs = Outputs()
        for due in plan.rounds:
            self._prefill_round([chunk for chunk in due if outputs.live(chunk.row)], outputs)
        for row, draft in plan.drafts:
            if outputs.live(row):
                self._verify(row, draft, outputs)
        decoding = [row for row in plan.decoding if outputs.live(row)]
        if decoding:
            outputs.decode_ran = True
            self._decode(decoding, outputs)
        return outputs

    def _prefill_round(self, due: list[Chunk], outputs: Outputs) -> None:
        """Each chunk of a round: natively in one batched forward where that pays, else one
        forward each, in admission order (rule 2)."""
        batches = self._runner.batches_chunks
        alone = [chunk for chunk in due
                 if not batches or chunk.row.sampler.sampling.prompt_logprobs is not None]
        together = [chunk for chunk in due if all(chunk is not other for other in alone)]
        widths = [self._runner.chunk_width(chunk.end - chunk.begin, chunk.row.length.room)
                  for chunk in together]
        if batch_pays(widths, self.slots):
            self._prefill_batched(together, outputs)
        else:
            alone.extend(together)
        for chunk in sorted(alone, key=lambda chunk: chunk.row.order):
            self._prefill_chunk(chunk, outputs)

    def _prefill_batched(self, group: list[Chunk], outputs: Outputs) -> None:
        """One forward [slots, S] over the engine's buffers: each chunk on its row, every other
        slot idle (query_seqlens 0: its cache is left as it was)."""
        members = {chunk.row.index: chunk for chunk in group}
        rows = []
        for index in range(self.slots):
            chunk = members.get(index)
            if chunk is None:
                rows.append(Row(np.array([0]), self._lengths[index], False))
            else:
                rows.append(Row(chunk.row.request.prompt[chunk.begin:chunk.end],
                                chunk.row.length))
        began = time.perf_counter()
        try:
            self._claim_batch()
            ran = self._runner.run(self._batch, Forward(rows))
        except CapacityError:
            # A slot near the capacity leaves no room for the padded width: run them apart.
            for chunk in group:
                self._prefill_chunk(chunk, outputs)
            return
        except Exception as error:  # the forward failed: every row of it fails with it
            outputs.failed.extend((chunk.row, error) for chunk in group)
            return
        assert ran.logits is not None  # a batched chunk forward returns each row's last logits
        seconds = (time.perf_counter() - began) / len(group)
        for index, chunk in members.items():
            outputs.prefilled.append(Prefilled(chunk, ran.width, seconds, ran.logits[index]))

    def _prefill_chunk(self, chunk: Chunk, outputs: Outputs) -> None:
        """The chunk in a forward of its own slot (rule 3 says which logits come back)."""
        row = chunk.row
        prompt = row.request.prompt
        top = row.sampler.sampling.prompt_logprobs
        need: LogitsRows = "all" if top is not None else "last" if chunk.last else "none"
        began = time.perf_counter()
        entries = None
        try:
            ran = self._runner.run(row.slot, Forward([Row(prompt[chunk.begin:chunk.end],
                                                          row.length)], need))
            logits = None if ran.logits is None else ran.logits[0]
            if top is not None:
                entries, logits = _prompt_logprobs(prompt, chunk.begin, chunk.end, logits, top)
        except Exception as error:  # any failure of this forward fails its request alone
            outputs.failed.append((row, error))
            return
        outputs.prefilled.append(Prefilled(chunk, ran.width, time.perf_counter() - began,
                                           logits, entries))

    def _verify(self, row: Running, draft: np.ndarray, outputs: Outputs) -> None:
        """Verify the row's draft in a forward of its own slot (rule 4; the scheduler rewinds
        the rows its tokens do not keep)."""
        fed = np.concatenate([np.array([row.token], dtype=np.int64), draft])
        began = time.perf_counter()
        try:
            logits = self._runner.run(row.slot, Forward([Row(fed, row.length)], "all")).logits
        except Exception as error:  # this row's forward failed: it fails alone
            outputs.failed.append((row, error))
            return
        assert logits is not None  # asked for every row's
        outputs.verified.append(Verified(row, draft, logits[0], time.perf_counter() - began))

    def _decode(self, decoding: list[Running], outputs: Outputs) -> None:
        """One batched decode forward: each row of `decoding` feeds its last token (rule 5)."""
        began = time.perf_counter()
        try:
            logits = self._decode_forward(decoding)
        except Exception as error:  # the forward failed: every row of it fails with it
            outputs.failed.extend((row, error) for row in decoding)
            return
        outputs.decoded_at = time.perf_counter()
        outputs.decoded = decoding
        outputs.decode_logits = logits
        outputs.decode_s = outputs.decoded_at - began

    def _decode_forward(self, decoding: list[Running]) -> np.ndarray | tuple[np.ndarray]:
        """The batched decode's forward of every slot (or the pinned step); each slot's logits
        row [vocab]."""
        if self.decode is not None:
            return (self.decode(decoding[0].token),)
        steps = {row.index: row.token for row in decoding}
        rows = [Row(np.array([steps.get(index, 0)]), self._lengths[index], index in steps)
                for index in range(self.slots)]
        self._claim_batch()
        logits = self._runner.run(self._batch, Forward(rows)).logits
        assert logits is not None  # a decode forward returns every row's last logits
        return logits

    def _claim_batch(self) -> None:
        """Run on the batch's bindings in this thread (rule 7; the runtime's engine, whose
        batch is a `SequenceSlot`)."""
        thread, batch = threading.get_ident(), self._batch
        if (self._release_graphs is not None and isinstance(batch, SequenceSlot)
                and batch.thread != thread):
            if batch.thread:
                self._release_graphs(batch.number)
            batch.thread = thread


def _prompt_logprobs(prompt: np.ndarray, begin: int, end: int, logits: np.ndarray | None,
                     top: int) -> tuple[list[TokenLogprobs | None], np.ndarray]:
    """The logprobs entries of the prompt tokens after rows [begin, end) (each row's logits
    predict the next token; None for the prompt's first token), and the last row's logits."""
    assert logits is not None  # asked for every row's
    following = prompt[begin + 1:end + 1]
    entries: list[TokenLogprobs | None] = [None] if begin == 0 else []
    entries.extend(prompt_logprobs_of(logits[:len(following)], following, top))
    return entries, logits[-1]
