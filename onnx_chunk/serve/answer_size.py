"""The size of an answer's logprobs, known from the request before any forward.

A request asks for a number of logprob entries: each token it may generate (every token its
length field allows, in every choice) and, with `echo`, each prompt token, times 1 + its top
count; with `prompt_logprobs`, each prompt token after the first times the larger of 1 and
that count. The request models count them (`answer_floor`); each entry takes at least
`ENTRY_BYTES[part]` bytes of the answer's JSON, so a request whose entries alone pass
`--max-answer-bytes` is refused before it is queued: 400 `answer_too_large`, naming the field
to lower, with its numbers.

The bytes of an entry, by where it goes:
- "chat": `{"token":"","logprob":0.0,"bytes":[]},`, 38 bytes, the least one can take;
- "prompt": vLLM's `"0":{"logprob":0.0,"rank":1,"decoded_token":""},`, 48, the least too;
- "completion" (the legacy `tokens`/`token_logprobs`/`top_logprobs`/`text_offset` lists):
  16, about the least in practice (a token of two characters and a number of eleven); one
  takes less only where two top tokens have the same text (the object keeps one) or a
  logprob is a short decimal (-35.5), so a request refused here very rarely would have fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx_chunk.serve.protocol import RequestError

ENTRY_BYTES = {"chat": 38, "prompt": 48, "completion": 16}


@dataclass(frozen=True)
class LogprobPart:
    """The logprob entries of one part of an answer: the field that sets their count, the
    format they are written in (a key of ENTRY_BYTES) and how many there are."""

    field: str
    kind: str
    entries: int

    @property
    def least_bytes(self) -> int:
        return self.entries * ENTRY_BYTES[self.kind]


@dataclass(frozen=True)
class AnswerFloor:
    """A request's logprob parts (see the module docstring)."""

    parts: tuple[LogprobPart, ...]

    @property
    def least_bytes(self) -> int:
        return sum(part.least_bytes for part in self.parts)

    def check(self, limit: int) -> None:
        """RequestError `answer_too_large` when the parts alone pass `limit` bytes, naming the
        field of the largest part."""
        least = self.least_bytes
        if least <= limit:
            return
        largest = max(self.parts, key=lambda part: part.least_bytes)
        counted = "; ".join(f"{part.entries} {part.kind} logprob entries (set by "
                            f"'{part.field}') at {ENTRY_BYTES[part.kind]} bytes each"
                            for part in self.parts)
        raise RequestError(
            f"the answer would have at least {least} bytes of logprobs ({counted}), more than "
            f"the {limit} bytes this server sends for one request (its --max-answer-bytes); "
            f"lower '{largest.field}', the tokens asked for, or the prompts or choices",
            param=largest.field, code="answer_too_large")
