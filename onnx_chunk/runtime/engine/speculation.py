"""Prompt-lookup speculative decoding: drafts from the text so far, verified in one forward.

A draft is the continuation of the latest earlier occurrence of the last few tokens (the
prompt and the tokens generated so far, no second model). The target decoder verifies the
last token and the k drafted ones in one forward of k + 1 rows with every row's logits; the
request's own `Sampler` then chooses a token per row (`Sampler.choose(logits, draft=...)`):
greedy takes the argmax, sampling the standard rejection rule for a deterministic draft
(accept the drafted token t with probability p(t), else draw from p with t removed), so every
chosen token is distributed exactly as plain decoding's. The tokens up to the first one that
differs from the draft are kept, that one included; the KV entries of the rejected rows are
rewound (the logical length goes back, the next forward overwrites them).

Rules:
1. `propose_draft`: the longest n-gram (from `max_ngram` down to `min_ngram`) ending the
   history that occurred before, its latest occurrence, and up to k tokens that followed it;
   nothing when no n-gram recurs.
2. `DraftBackoff`: a verification that accepts nothing doubles the plain decode steps run
   before the next draft (1, 2, 4, ... up to `MAX_BACKOFF`); one that accepts a token resets
   it, so text the drafts cannot predict costs at most one wasted verification per back-off.
   The draft length follows the request's record (`draft_length`): with an acceptance rate a
   per drafted token (kept over kept plus rejections, recent verifications weighing most) and
   a confidence rate c (the share of recent steps whose greedy lead reached the margin of
   rule 3: a verification's first row below it gives no token at all), a draft of k tokens
   gives about c * (1 + ac + ... + (ac)^k) tokens (row i gives one where the drafts before
   it were kept and every row up to it leads by the margin) for a forward that costs about
   1 + `VERIFY_ROW_COST` * k decode steps; the k that gives most per cost is drafted. When
   none gives more than a decode step the request backs off and later drafts one token as a
   probe, provided a probe could pay at all (c * (1 + c) > 1 + `VERIFY_ROW_COST`: a kept
   draft, both rows above the margin). So drafting pays where the drafts have been right and
   stops where they have not, or where the decoder is too rarely sure of its next token for
   a verification to be trusted (a random-weight INT4 export: 23% of steps lead by 0.25).
   The confidence is read at every plain decode step of a greedy request without
   processors (two passes over the logits row, about 0.06 ms at vocab 151936) and at every
   verification's first row; other requests count as always confident.
3. Greedy verification is exact only where the verification's argmax is the one a decode step
   would pick. ONNX Runtime computes a one-row forward with other kernels than a multi-row one
   (INT4 MatMulNBits: logits differ by up to about 0.06 on a Qwen2.5-0.5B-shaped export, float
   decoders by about 1e-5; multi-row widths agree exactly among themselves), so a greedy row
   counts only when its best score leads the runner-up by `Speculation.margin` (0.25 for a
   quantized decoder, 1e-3 for a float one); a closer row ends the verification without a
   token, and the next step decodes it plainly, at one row.
4. `speculation_refused`: a decoder with recurrent state (its state holds no history, so the
   rejected rows cannot be taken back) or one that returns the last row's logits only (no
   per-row verification) is refused at load with the reason. A window-sized KV cache is
   handled exactly: a draft runs only when rewinding every row of its verification would lose
   nothing the window still needs (`kv_window.rewind_is_exact`), else that step decodes plainly.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np

from onnx_chunk.runtime.engine.kv_window import rewind_is_exact
from onnx_chunk.runtime.state.ports import ModelPorts
from onnx_chunk.sampling import Sampler, TokenLogprobs

PROMPT_LOOKUP = "prompt-lookup"
SPECULATIVE_CHOICES = (PROMPT_LOOKUP,)
# The most tokens drafted per verification, and the n-gram sizes looked up.
DRAFT_TOKENS = 8
# What each drafted row adds to a verification, in decode steps: on 2 CPU cores a
# Qwen2.5-0.5B-shaped INT4 verification of k + 1 rows after 1000 cached tokens cost 1.25x a
# decode step for k = 1, 1.35x for 2, 1.74x for 4, 2.52x for 8.
VERIFY_ROW_COST = 0.25
# The acceptance record: a prior of one kept and one rejected token, older verifications
# decaying by this factor at each new one.
_RECORD_DECAY = 0.8
# The confidence record: a prior of one confident step, older steps decaying by this factor at
# each new one (steps are many more than verifications: about the last 20 weigh).
_CONFIDENCE_DECAY = 0.95
MAX_NGRAM = 3
MIN_NGRAM = 1
# The most plain decode steps a request runs between two drafts after failed verifications.
MAX_BACKOFF = 32
# The lead of a greedy row's best score over the runner-up below which the verification's
# choice is not trusted (rule 3): quantized (MatMulNBits) and float decoders.
QUANTIZED_MARGIN = 0.25
FLOAT_MARGIN = 1e-3


@dataclass(frozen=True)
class Speculation:
    """How a runtime's requests draft and verify: the window-sized caches a draft must be able
    to rewind ((rows, window) each) and the greedy margin (rule 3)."""

    windows: tuple[tuple[int, int], ...] = ()
    margin: float = FLOAT_MARGIN

    @classmethod
    def for_ports(cls, ports: ModelPorts, quantized: bool) -> Speculation:
        return cls(tuple((port.shape[2], port.window) for port in ports.kv
                         if port.window is not None),
                   QUANTIZED_MARGIN if quantized else FLOAT_MARGIN)


def propose_draft(history: np.ndarray, k: int = DRAFT_TOKENS, *, max_ngram: int = MAX_NGRAM,
                  min_ngram: int = MIN_NGRAM) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
    ending `history` (rule 1); an empty array when none recurs."""
    size = len(history)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = history[size - n:]
        # Starts of earlier occurrences: the n-gram ends before the history's last token.
        starts = np.flatnonzero(history[:size - n] == tail[0])
        for start in starts[::-1]:
            if np.array_equal(history[start:start + n], tail):
                return history[start + n:start + n + k].copy()
    return np.empty(0, dtype=history.dtype)


class DraftBackoff:
    """When a request drafts next (rule 2): exponential back-off on failed verifications."""

    def __init__(self) -> None:
        self._wait = 0
        self._penalty = 1

    def ready(self) -> bool:
        """Whether this step may draft (else it is a plain decode step, counted down)."""
        if self._wait > 0:
            self._wait -= 1
            return False
        return True

    def verified(self, accepted: int) -> None:
        """Record a verification that accepted `accepted` drafted tokens."""
        if accepted:
            self._penalty = 1
            return
        self._wait = self._penalty
        self._penalty = min(2 * self._penalty, MAX_BACKOFF)


def draft_length(acceptance: float, confidence: float = 1.0, most: int = DRAFT_TOKENS) -> int:
    """The draft length (1 to `most`) that gives most tokens per cost at this acceptance and
    confidence rate, or 0 when none gives more than a plain decode step (rule 2)."""
    best, best_gain = 0, 1.0
    for k in range(1, most + 1):
        rate = acceptance * confidence
        gain = confidence * sum(rate ** i for i in range(k + 1)) / (1 + VERIFY_ROW_COST * k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def probe_may_pay(confidence: float) -> bool:
    """Whether a one-token probe could give more than a decode step: a kept draft and both
    rows trusted, at this confidence rate (rule 2)."""
    return confidence * (1 + confidence) > 1 + VERIFY_ROW_COST


class Drafter:
    """One request's prompt-lookup drafting: its history, its acceptance record, its back-off."""

    def __init__(self, prompt: np.ndarray, speculation: Speculation) -> None:
        self._history = np.empty(max(16, 2 * len(prompt)), dtype=np.int64)
        self._history[:len(prompt)] = prompt
        self._size = len(prompt)
        self._speculation = speculation
        self.backoff = DraftBackoff()
        self._kept = 1.0
        self._rejected = 1.0
        self._confident = 1.0
        self._steps = 1.0

    @property
    def acceptance(self) -> float:
        """The estimated chance that a drafted token is kept (recent verifications weigh most)."""
        return self._kept / (self._kept + self._rejected)

    @property
    def confidence(self) -> float:
        """The estimated chance that a step's greedy lead reaches the margin (rule 2)."""
        return self._confident / self._steps

    def observe(self, sampler: Sampler, logits: np.ndarray, token: int) -> None:
        """Count a plain decode step's [vocab] logits row, from which `sampler` chose `token`,
        in the confidence record (only where the margin applies and the lead can be read
        without touching the sampler's state: a greedy request without processors, whose
        `token` is the row's argmax)."""
        margin = self._speculation.margin
        if margin > 0 and sampler.sampling.greedy and sampler.unprocessed_greedy:
            self._count_step(sampler.lead(logits, best=token) >= margin)

    def _count_step(self, confident: bool) -> None:
        self._confident = _CONFIDENCE_DECAY * self._confident + confident
        self._steps = _CONFIDENCE_DECAY * self._steps + 1

    def extend(self, tokens: SequenceOf[int]) -> None:
        """Append generated tokens to the history drafts are looked up in."""
        end = self._size + len(tokens)
        if end > len(self._history):
            grown = np.empty(2 * end, dtype=np.int64)
            grown[:self._size] = self._history[:self._size]
            self._history = grown
        self._history[self._size:end] = tokens
        self._size = end

    def draft(self, length: int, room: int) -> np.ndarray:
        """The draft for the next step of a sequence at `length` positions with `room` new
        tokens left to generate after the next one (empty: decode plainly)."""
        # A request whose drafts do not pay probes with one token after its back-off, where a
        # probe could pay.
        ready = self.backoff.ready()
        k = min(draft_length(self.acceptance, self.confidence)
                or (1 if probe_may_pay(self.confidence) else 0), room)
        if k < 1 or not ready:
            return np.empty(0, dtype=np.int64)
        draft = propose_draft(self._history[:self._size], k)
        # A verification may keep no row at all (rule 3): all its rows must rewind exactly.
        total = length + 1 + len(draft)
        if any(not rewind_is_exact(total, total - length, capacity, window)
               for capacity, window in self._speculation.windows):
            return np.empty(0, dtype=np.int64)
        return draft

    def verified(self, sampler: Sampler, logits: np.ndarray, draft: np.ndarray) -> Verified:
        """`verify`, with the record and the back-off updated (rule 2)."""
        result = verify(sampler, logits, draft, self._speculation.margin)
        if self._speculation.margin > 0 and sampler.sampling.greedy:
            # No token at all: the first row's lead was below the margin.
            self._count_step(bool(result.tokens))
        kept = accepted(result.tokens, draft)
        self._kept = _RECORD_DECAY * self._kept + kept
        self._rejected = _RECORD_DECAY * self._rejected + (kept < len(draft))
        self.backoff.verified(1 if draft_length(self.acceptance, self.confidence) else 0)
        return result


def speculation_refused(ports: ModelPorts) -> str | None:
    """Why this decoder cannot verify drafts (rule 3), or None when it can."""
    if ports.state:
        return ("this decoder carries recurrent state, which holds no history, so the rows "
                "of a rejected draft cannot be taken back")
    if ports.last_row_logits:
        return ("the decoder returns the last row's logits only, so a draft's rows cannot be "
                "verified in one forward")
    return None


@dataclass(frozen=True)
class Verified:
    """A verification's tokens, each with the logprobs of the row it was chosen from (None
    where the request asks for none)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


def verify(sampler: Sampler, logits: np.ndarray, draft: np.ndarray,
           margin: float = 0.0) -> Verified:
    """The tokens a verification gives: one per row of `logits` ([len(draft) + 1, vocab]) up
    to and including the first that differs from the draft; a greedy row whose best score
    leads by less than `margin` ends them without a token (rule 3)."""
    result = Verified([], [])
    for index, row in enumerate(logits):
        drafted = int(draft[index]) if index < len(draft) else None
        if sampler.sampling.greedy and margin > 0 and sampler.lead(row) < margin:
            break
        token = sampler.choose(row, draft=drafted)
        result.tokens.append(token)
        result.logprobs.append(sampler.last)
        if token != drafted:
            break
    return result


def accepted(tokens: list[int], draft: np.ndarray) -> int:
    """How many drafted tokens `tokens` (what `verify` gave) kept."""
    return sum(1 for token, drafted in zip(tokens, draft) if token == drafted)
