"""A multi-turn chat that keeps the conversation in one sequence's KV cache.

Each turn renders the chat template over the whole conversation and feeds only what the cache
does not hold yet (`continuation`): when the ids the cache holds are a prefix of the new
rendering's ids, the rest of those ids; else, when the text they stand for is a prefix of the
new rendering, the encoding of the rest of the text (the model's own tokens of its last reply
stay as they were generated, where re-encoding the reply would split it differently); else the
sequence is emptied and the whole rendering is fed again, with the reason logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onnx_chunk.errors import CapacityError
from onnx_chunk.sampling import Sampling
from onnx_chunk.text.generation import Completion, SequenceTokens, TextGeneration, default_sampling
from onnx_chunk.text.stops import check_stops

if TYPE_CHECKING:
    from onnx_chunk.runtime.model import Runtime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    """What a turn feeds: the ids, whether the cache was kept, and how that was decided."""

    ids: list[int]
    reused: int
    how: str


def continuation(cached_ids: SequenceOf[int], cached_text: str, new_ids: SequenceOf[int],
                 new_text: str, encode: Callable[[str], list[int]]) -> Continuation:
    """The ids to feed after `cached_ids` (standing for `cached_text`) to hold the new rendering.

    `reused` 0 means the cache must be emptied first: `ids` are then the whole rendering.
    """
    held = len(cached_ids)
    if not held:
        return Continuation(list(new_ids), 0, "empty cache")
    if len(new_ids) > held and list(new_ids[:held]) == list(cached_ids):
        return Continuation(list(new_ids[held:]), held, "token prefix")
    if len(new_text) > len(cached_text) and new_text.startswith(cached_text):
        return Continuation(encode(new_text[len(cached_text):]), held, "text prefix")
    return Continuation(list(new_ids), 0, "the cached conversation is no prefix of the new "
                                          "rendering (the template rewrites earlier turns)")


@dataclass(frozen=True)
class TurnStats:
    """One turn: the ids fed, how many the cache already held, and how that was decided."""

    fed_ids: tuple[int, ...]
    reused_tokens: int
    how: str


class Conversation:
    """A chat on one sequence of `runtime`; `say` a user message, iterate the reply's text.

    reuse_cache=False feeds the whole conversation every turn (for comparison).
    """

    def __init__(self, runtime: Runtime, *, system: str | None = None,
                 reuse_cache: bool = True) -> None:
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.reuse_cache = reuse_cache
        self.messages: list[dict[str, str]] = ([] if system is None
                                               else [{"role": "system", "content": system}])
        self._sequence = runtime.open_sequence()
        self._cached_ids: list[int] = []
        self._cached_text = ""
        self.last_turn: TurnStats | None = None
        self.last_completion: Completion | None = None

    @property
    def cached_ids(self) -> tuple[int, ...]:
        """The ids the sequence's KV cache holds for the conversation so far."""
        return tuple(self._cached_ids)

    def say(self, content: str, max_new_tokens: int, *, sampling: Sampling | None = None,
            stop: str | Iterable[str] | None = None) -> Iterator[str]:
        """The assistant's reply to `content`, as it is produced (checked before any work)."""
        tokenizer = self.tokenizer
        messages = [*self.messages, {"role": "user", "content": content}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        if self.reuse_cache and self._sequence.length == len(self._cached_ids):
            plan = continuation(self._cached_ids, self._cached_text, ids, rendered,
                                lambda text: tokenizer.encode(text, add_special_tokens=False))
        else:
            plan = Continuation(ids, 0, "cache reuse off" if not self.reuse_cache
                                else "the last reply was not read to its end")
        # Everything that can refuse the turn runs before the cache is touched.
        check_stops(stop)
        sampling = default_sampling(tokenizer, sampling)
        room = self._sequence.capacity - (0 if plan.reused == 0 else self._sequence.length)
        if len(plan.ids) >= room:
            raise CapacityError(
                f"the conversation needs {len(plan.ids)} more positions and a reply, but "
                f"{room} of the {self._sequence.capacity}-position capacity are left; start a "
                "new conversation or load the model with a larger capacity")
        if plan.reused == 0 and self._sequence.length:
            logger.info("feeding the whole conversation again: %s", plan.how)
            self._sequence.rewind(self._sequence.length)
        held = self._cached_ids[:plan.reused]
        generation = TextGeneration(SequenceTokens(self._sequence), tokenizer, plan.ids,
                                    max_new_tokens,
                                    sampling=sampling, stop=stop)
        self.last_turn = TurnStats(tuple(plan.ids), plan.reused, plan.how)
        return self._turn(generation, messages, [*held, *plan.ids], rendered)

    def _turn(self, generation: TextGeneration, messages: list[dict[str, str]],
              fed: list[int], rendered: str) -> Iterator[str]:
        """Run the reply; then the conversation lists it and the cache is known to hold
        `fed` (standing for `rendered`) and the reply's tokens but the last (never fed back)."""
        self._cached_ids, self._cached_text = [], ""
        yield from generation
        completion = generation.completion
        assert completion is not None  # set when the iteration ended
        self.last_completion = completion
        self.messages = [*messages, {"role": "assistant", "content": completion.text}]
        reply = list(completion.tokens[:-1])
        self._cached_ids = [*fed, *reply]
        self._cached_text = rendered + self.tokenizer.decode(reply)
