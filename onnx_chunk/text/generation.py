"""Text generation around a sequence's token loop: prompt to ids, ids to streamed text, stops.

A prompt is text (encoded with the tokenizer's special tokens, BOS where it adds one) or a
list of messages (rendered through the chat template with add_generation_prompt=True, then
encoded without adding special tokens, as transformers' apply_chat_template does). The text
is the decode of the new tokens without special tokens, streamed through `TextStream`, cut by
`StopMatcher`. A generation ends, and its `finish_reason` says why, at:
- "stop": an EOS id (the token is in `tokens`, not in the text) or a stop string (the text
  ends before it; `tokens` include the token that completed it);
- "length": `max_new_tokens` tokens;
- "capacity": the sequence's KV capacity, when it holds fewer than `max_new_tokens` more.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from onnx_chunk.errors import CapacityError
from onnx_chunk.runtime.stats import GenerationStats
from onnx_chunk.sampling import GREEDY, Sampling
from onnx_chunk.text.stops import check_stops
from onnx_chunk.text.token_text import TokenText

if TYPE_CHECKING:
    from onnx_chunk.runtime.sequence import Sequence
    from onnx_chunk.text.tokenizer import Tokenizer

# Text, or a conversation: [{"role": ..., "content": ...}, ...].
Prompt = Union[str, SequenceOf[Mapping[str, Any]]]


@dataclass(frozen=True)
class Completion:
    """One text generation: its text, new tokens, why it ended, and its statistics (timings,
    left out of equality)."""

    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int
    stats: GenerationStats | None = field(default=None, compare=False)


def prompt_ids(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """The ids a prompt (text or messages) is fed as."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return tokenizer.encode(tokenizer.apply_chat_template(prompt, add_generation_prompt=True),
                            add_special_tokens=False)


def default_sampling(tokenizer: Tokenizer, sampling: Sampling | None) -> Sampling:
    """`sampling`, else the genai_config.json `search` defaults, else greedy."""
    if sampling is not None:
        return sampling
    genai = tokenizer.genai
    return GREEDY if genai is None else Sampling.from_search(genai.search)


class TextGeneration:
    """One text request on a sequence; iterate it for the text as it is produced.

    Every check (the prompt's ids, max_new_tokens, the stop strings, the room left) runs at
    construction, before any work. `completion` is set once the iteration has ended.
    """

    def __init__(self, sequence: Sequence, tokenizer: Tokenizer, ids: SequenceOf[int],
                 max_new_tokens: int, *, sampling: Sampling,
                 stop: str | Iterable[str] | None = None) -> None:
        self._stops = check_stops(stop)
        self.prompt_tokens = len(ids)
        try:
            checked = sequence.check_request(ids, max_new_tokens)
            budget, at_budget = int(max_new_tokens), "length"
        except CapacityError:
            budget = sequence.capacity - sequence.length - len(ids)
            if budget < 1:
                raise
            checked, at_budget = sequence.check_request(ids, budget), "capacity"
        self.completion: Completion | None = None
        self._steps = self._run(sequence, tokenizer, checked, budget, at_budget, sampling)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._steps)

    def close(self) -> None:
        """Stop early (what was generated stays in the sequence)."""
        self._steps.close()

    def _run(self, sequence: Sequence, tokenizer: Tokenizer, ids, budget: int,
             at_budget: str, sampling: Sampling) -> Iterator[str]:
        text = TokenText(tokenizer, self._stops)
        pieces: list[str] = []
        # The sequence stops on the same ids, so its stats agree with the finish reason.
        steps = sequence.stream(ids, budget, eos_token_id=tokenizer.eos_token_ids,
                                sampling=sampling)
        try:
            for token in steps:
                piece = text.push(token)
                if piece:
                    pieces.append(piece)
                    yield piece
                if text.stopped:
                    break
        finally:
            steps.close()
        piece = text.finish()
        if piece:
            pieces.append(piece)
            yield piece
        self.completion = Completion(text="".join(pieces), tokens=tuple(text.tokens),
                                     finish_reason="stop" if text.stopped else at_budget,
                                     prompt_tokens=self.prompt_tokens,
                                     stats=sequence.stats.last_generation)


def stream_text(sequence: Sequence, tokenizer: Tokenizer, prompt: Prompt, max_new_tokens: int,
                *, sampling: Sampling | None = None,
                stop: str | Iterable[str] | None = None) -> TextGeneration:
    """A text generation of `prompt` on `sequence` (checked now, run as it is iterated)."""
    return TextGeneration(sequence, tokenizer, prompt_ids(tokenizer, prompt), max_new_tokens,
                          sampling=default_sampling(tokenizer, sampling), stop=stop)


def generate_text(sequence: Sequence, tokenizer: Tokenizer, prompt: Prompt,
                  max_new_tokens: int, *, sampling: Sampling | None = None,
                  stop: str | Iterable[str] | None = None) -> Completion:
    """Run a text generation to its end; its Completion."""
    generation = stream_text(sequence, tokenizer, prompt, max_new_tokens, sampling=sampling,
                             stop=stop)
    for _ in generation:
        pass
    return generation.completion
