"""A multi-turn chat on the batch engine, the conversation kept in a slot's KV by prefix reuse.

Each turn renders the chat template over the whole conversation (`PromptEncoder`, the text
API's policy: typed special tokens are control tokens) and submits the ids of the
conversation so far (`continuation`): when the ids the slot was fed are a prefix of the new
rendering's ids, those ids and the rest of the rendering's; else, when the text they stand for
is a prefix of the new rendering, those ids and the encoding of the rest of the text (the
model's own tokens of its last reply stay as they were generated, where re-encoding the reply
would split it differently); else the whole rendering, with the reason logged. The engine's
prefix reuse (docs/engine.md) then prefills only what the slot does not hold: one generation
loop for a chat, a server request and a batch. A runtime serving others meanwhile may have
handed the slot to another request; the turn then prefills more, with the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onnx_chunk.errors import CapacityError
from onnx_chunk.sampling import Sampling
from onnx_chunk.text.generation import Completion, EngineTokens, TextGeneration, default_sampling
from onnx_chunk.text.prompt import PromptEncoder
from onnx_chunk.text.stops import check_stops
from onnx_chunk.text.tokenizer import tokenizer_of

if TYPE_CHECKING:
    from onnx_chunk.runtime.facade import Runtime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    """What a turn adds after the kept ids: the ids, how many kept ids stay (0: none, the ids
    are the whole rendering), and how that was decided."""

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
    """One turn: the ids prefilled, how many the slot already held (the engine's count of the
    reused prefix), and how the ids submitted were decided."""

    fed_ids: tuple[int, ...]
    reused_tokens: int
    how: str


class Conversation:
    """A chat on `runtime`'s batch engine; `say` a user message, iterate the reply's text.

    reuse_cache=False submits the whole rendering, encoded again, every turn (the model's own
    reply tokens are not kept); whether the engine then reuses a prefix is the runtime's
    `prefix_reuse` (load it with prefix_reuse=False to feed the whole conversation, for
    comparison).
    """

    def __init__(self, runtime: Runtime, *, system: str | None = None,
                 reuse_cache: bool = True) -> None:
        self.runtime = runtime
        self.tokenizer = tokenizer_of(runtime)
        self.prompts = PromptEncoder(self.tokenizer)
        self.reuse_cache = reuse_cache
        self.messages: list[dict[str, str]] = ([] if system is None
                                               else [{"role": "system", "content": system}])
        self._cached_ids: list[int] = []
        # A reply began and was not read to its end: what its slot holds is not known here.
        self._reply_open = False
        self._cached_text = ""
        self.last_turn: TurnStats | None = None
        self.last_completion: Completion | None = None

    @property
    def cached_ids(self) -> tuple[int, ...]:
        """The ids the conversation's slot was fed so far (its prompts and replies, but each
        reply's last token)."""
        return tuple(self._cached_ids)

    def say(self, content: str, max_new_tokens: int, *, sampling: Sampling | None = None,
            stop: str | Iterable[str] | None = None) -> Iterator[str]:
        """The assistant's reply to `content`, as it is produced (checked before any work)."""
        tokenizer = self.tokenizer
        messages = [*self.messages, {"role": "user", "content": content}]
        chat = self.prompts.render(messages)
        rendered, ids = chat.text, chat.ids
        if self.reuse_cache and self._cached_ids:
            plan = continuation(self._cached_ids, self._cached_text, ids, rendered,
                                lambda text: tokenizer.encode(text, add_special_tokens=False))
        else:
            plan = Continuation(ids, 0, "cache reuse off" if not self.reuse_cache
                                else "the last reply was not read to its end"
                                if self._reply_open else "empty cache")
        # Everything that can refuse the turn runs before anything is submitted.
        check_stops(stop)
        sampling = default_sampling(tokenizer, sampling)
        prompt = [*self._cached_ids[:plan.reused], *plan.ids]
        capacity = self.runtime.stats.capacity
        if len(prompt) >= capacity:
            raise CapacityError(
                f"the conversation needs {len(prompt)} positions and a reply, more than the "
                f"{capacity}-position capacity holds; start a new conversation or load the "
                "model with a larger capacity")
        if plan.reused == 0 and self._cached_ids:
            logger.info("submitting the whole conversation again: %s", plan.how)
        generation = TextGeneration(EngineTokens(self.runtime), tokenizer, prompt,
                                    max_new_tokens, sampling=sampling, stop=stop)
        return self._turn(generation, messages, prompt, rendered, plan.how)

    def _turn(self, generation: TextGeneration, messages: list[dict[str, str]],
              fed: list[int], rendered: str, how: str) -> Iterator[str]:
        """Run the reply; then the conversation lists it, and its slot was fed `fed`
        (standing for `rendered`) and the reply's tokens but the last (never fed back)."""
        self._cached_ids, self._cached_text = [], ""
        self._reply_open = True
        yield from generation
        self._reply_open = False
        completion = generation.completion
        assert completion is not None and completion.stats is not None  # set at the end
        reused = completion.stats.cached_tokens
        self.last_turn = TurnStats(tuple(fed[reused:]), reused, how)
        self.last_completion = completion
        self.messages = [*messages, {"role": "assistant", "content": completion.text}]
        reply = list(completion.tokens[:-1])
        self._cached_ids = [*fed, *reply]
        self._cached_text = rendered + self.tokenizer.decode(reply)
