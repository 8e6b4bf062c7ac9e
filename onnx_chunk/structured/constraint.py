"""A JSON schema as a token constraint: llguidance's matcher, its bitmask turned into -inf.

The grammar library's tokenizer (the token byte strings and the tokenizer's trie, about a
second for a 150k vocabulary) is built once per `Tokenizer` and kept with it; a schema compiles
in about a millisecond per request. Each decode step the matcher writes one bit per token into
a preallocated int32 bitmask (in Rust), and numpy turns the cleared bits into -inf over the
whole row with preallocated buffers: no Python loop over the vocabulary, no allocation of its
size. Ids the model has beyond the tokenizer's vocabulary (padding rows) are always forbidden.
The output ends where the grammar accepts it: the EOS ids are allowed only there.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from onnx_chunk.errors import ConfigError, InputError, OnnxChunkError
from onnx_chunk.text.tokenizer import TOKENIZER_FILE

if TYPE_CHECKING:
    from onnx_chunk.text.tokenizer import Tokenizer

# JSON as json.dumps writes it by default (", " and ": "), with no other whitespace: a model
# cannot stall in an endless run of blanks.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = np.array([1 << bit for bit in range(8)], dtype=np.uint8)

_grammar_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class GrammarError(OnnxChunkError):
    """The grammar reached a state it cannot leave (a token it forbade was fed to it)."""


def json_constraint(tokenizer: Tokenizer, schema: Mapping[str, Any] | bool,
                    vocab_size: int) -> GrammarConstraint:
    """The constraint that the output is one JSON value valid under `schema` (InputError when
    the schema is malformed or uses what the grammar library does not support).

    `vocab_size`: the model's logits width (at least the tokenizer's vocabulary).
    """
    llguidance = _library()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as error:
        raise InputError(f"the JSON schema cannot be compiled: {error}") from error
    return GrammarConstraint(_grammar_tokenizer(tokenizer), grammar, vocab_size)


class GrammarConstraint:
    """A compiled grammar over one tokenizer (a `Sampling.constraint`); `matcher()` per
    request."""

    def __init__(self, grammar_tokenizer: Any, grammar: str, vocab_size: int) -> None:
        llguidance = _library()
        problem = llguidance.LLMatcher.validate_grammar(grammar, grammar_tokenizer)
        if problem:
            raise InputError(f"the grammar compiled from the JSON schema is refused: {problem}")
        if grammar_tokenizer.vocab_size > vocab_size:
            raise ConfigError(f"the tokenizer has {grammar_tokenizer.vocab_size} tokens, more "
                              f"than the model's {vocab_size} logits")
        self._tokenizer = grammar_tokenizer
        self.grammar = grammar
        self.vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self)


class GrammarMatcher:
    """One request's place in the grammar (see `Sampling.constraint`)."""

    def __init__(self, constraint: GrammarConstraint) -> None:
        llguidance = _library()
        self._matcher = llguidance.LLMatcher(constraint._tokenizer, constraint.grammar,
                                             log_level=0)
        self._check()
        words = constraint._tokenizer.vocab_size
        self._words = words
        self._bitmask = np.empty((words + 31) // 32, dtype=np.int32)
        self._bytes = self._bitmask.view(np.uint8)
        self._bits = np.empty((self._bytes.size, 8), dtype=np.uint8)
        self._forbidden = np.empty(self._bits.size, dtype=bool)

    def restrict(self, scores: np.ndarray) -> None:
        """-inf on the scores of the tokens the grammar forbids now."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        self._check()
        np.bitwise_and(self._bytes[:, None], _BITS, out=self._bits)
        np.equal(self._bits.reshape(-1), 0, out=self._forbidden)
        words = self._words
        np.copyto(scores[:words], -np.inf, where=self._forbidden[:words])
        scores[words:] = -np.inf

    def advance(self, token: int) -> None:
        """Move past `token`; GrammarError when the grammar forbids it."""
        if token < self._words and self._matcher.consume_token(token):
            return
        self._check()
        raise GrammarError(f"token {token} does not follow the grammar here; the sampler "
                           "chose a token its mask forbade (a defect)")

    @property
    def accepting(self) -> bool:
        """Whether the output so far is complete under the grammar."""
        return self._matcher.is_accepting()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"the grammar matcher failed: {self._matcher.get_error()}")


def prepare(tokenizer: Tokenizer) -> None:
    """Build the grammar library's tokenizer for `tokenizer` now (about a second at a 150k
    vocabulary; the server runs it off its event loop before the first constrained request)."""
    _grammar_tokenizer(tokenizer)


def _grammar_tokenizer(tokenizer: Tokenizer) -> Any:
    """llguidance's tokenizer for `tokenizer` (built on first use, kept with it)."""
    with _lock:
        built = _grammar_tokenizers.get(tokenizer)
        if built is None:
            llguidance = _library()
            if not tokenizer.eos_token_ids:
                raise ConfigError("the tokenizer has no EOS token, so a constrained output "
                                  "cannot end; set eos_token in tokenizer_config.json")
            path = tokenizer.folder / TOKENIZER_FILE
            try:
                built = llguidance.LLTokenizer(path.read_text(encoding="utf-8"),
                                               n_vocab=tokenizer.vocab_size,
                                               eos_token=list(tokenizer.eos_token_ids))
            except BaseException as error:  # its Rust panics derive from BaseException
                if isinstance(error, (KeyboardInterrupt, SystemExit)):
                    raise
                raise ConfigError(f"the grammar library cannot read {str(path)!r} "
                                  f"({type(error).__name__}: {error}); structured output is "
                                  "unavailable for this tokenizer") from error
            _grammar_tokenizers[tokenizer] = built
        return built


def _library() -> Any:
    try:
        import llguidance
    except ImportError as error:
        raise ConfigError("structured output needs llguidance: pip install "
                          "'onnx-chunk[structured]'") from error
    return llguidance
