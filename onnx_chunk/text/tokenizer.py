"""The model folder's tokenizer (`tokenizer.json`, HF's Rust tokenizer) read as transformers
reads it.

transformers' tokenizer (version 5, the one onnxruntime-genai's builder exports with) is the
`tokenizers` model of `tokenizer.json` plus the special tokens `tokenizer_config.json` names
(strings or serialized AddedTokens; the legacy `special_tokens_map.json` when the config lists
no added tokens). What `encode` adds is `tokenizer.json`'s own post-processor: with a
`tokenizer.json` present, transformers 5 drops `add_bos_token`/`add_eos_token` from the config;
only a class that rebuilds the post-processor in its constructor (GPT-NeoX: no BOS, no EOS)
replaces it (measured against transformers 5.24 in tests/text/test_parity.py). A chat template
gets the named special tokens only (transformers 5 passes no `additional_special_tokens`).
Padding and truncation stored in `tokenizer.json` are switched off, as transformers does for a
plain `encode`.
The EOS ids are genai_config.json's `eos_token_id` when it has one (onnxruntime-genai stops
on those), else the tokenizer's EOS token.

Encoding releases the GIL (the Rust batch call), so a long text encoded on a worker thread
leaves the other threads (a server's event loop) running. `max_token_chars` bounds the text a
token can stand for, so a text too long for a context is refused before it is encoded. A prompt
(text or messages) becomes ids through `onnx_chunk.text.prompt.PromptEncoder`, the one
encoder, which holds the special-token policy.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_chunk.errors import CapacityError, InputError, ModelLoadError
from onnx_chunk.graph.model_folder import GenaiConfig, locate_model, read_json_object
from onnx_chunk.text.chat_template import ChatTemplate, find_chat_template

if TYPE_CHECKING:
    from onnx_chunk.runtime.facade import Runtime

logger = logging.getLogger(__name__)

# The tokenizer classes whose transformers 5 constructor rebuilds the post-processor, with the
# (add_bos_token, add_eos_token) it rebuilds it from (the config's own flags are dropped).
_REBUILT_POST_PROCESSORS = {
    "GPTNeoXTokenizer": (False, False),
}

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"

# The special-token attributes transformers passes to a chat template (its
# SPECIAL_TOKENS_ATTRIBUTES), in its order.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")

# The parts of a tokenizer.json pipeline that never make the text shorter, so that a token
# stands for at most its own length in characters of the text (pre-tokenizers that drop
# whitespace, normalizers that strip, models that fuse unknown characters into one token do
# not: no bound holds for them). Unicode composition joins at most 4 code points into one.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts",
                           "Split"}
_KEEPING_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD", "Replace"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_COMPOSED_CODE_POINTS = 4

@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens a tokenizer config declares, as strings (None: not declared)."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    sep_token: str | None = None
    pad_token: str | None = None
    cls_token: str | None = None
    mask_token: str | None = None

    def template_variables(self) -> dict[str, Any]:
        """What transformers passes a chat template: each declared token by its name."""
        return {name: getattr(self, name) for name in SPECIAL_TOKEN_NAMES if getattr(self, name)}


class Tokenizer:
    """Text <-> token ids for one model folder."""

    def __init__(self, backend: Any, config: dict[str, Any], special: SpecialTokens,
                 genai: GenaiConfig | None, folder: Path) -> None:
        self._backend = backend
        self.config = config
        self.special_tokens = special
        self.folder = folder
        self.genai = genai
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(int(index) for index, token in added.items()
                                      if token.special)
        self._added = {int(index): token.content for index, token in added.items()}
        own_eos = self.token_id(special.eos_token)
        genai_eos = genai.eos_token_ids if genai is not None else ()
        if genai_eos and own_eos is not None and own_eos not in genai_eos:
            logger.warning("the tokenizer's eos_token %r (id %d) is not among genai_config's "
                           "eos_token_id %s; stopping on genai_config's, as onnxruntime-genai "
                           "does", special.eos_token, own_eos, list(genai_eos))
        self.eos_token_ids: tuple[int, ...] = (tuple(genai_eos) if genai_eos else
                                               (() if own_eos is None else (own_eos,)))
        self.bos_token_id: int | None = self.token_id(special.bos_token)

    @classmethod
    def load(cls, folder: Path, genai: GenaiConfig | None = None) -> Tokenizer:
        """The tokenizer of the model in `folder`; ModelLoadError when it has none or it is bad."""
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise ModelLoadError(
                f"the model folder {str(folder)!r} has no {TOKENIZER_FILE}, so text cannot be "
                f"encoded or decoded; copy the {TOKENIZER_FILE} and {TOKENIZER_CONFIG} the model "
                "was exported with beside it, or pass token ids instead of text")
        from tokenizers import Tokenizer as Backend

        try:
            backend = Backend.from_file(str(path))
        except Exception as error:  # the Rust side raises plain Exceptions for bad files
            raise ModelLoadError(f"cannot read {str(path)!r} as a tokenizer ({error}); "
                                 "replace it with the model's tokenizer.json") from error
        backend.no_padding()
        backend.no_truncation()
        config = _tokenizer_file(folder / TOKENIZER_CONFIG)
        special = _special_tokens(config, folder)
        _rebuild_post_processor(backend, config, special)
        return cls(backend, config, special, genai, folder)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (added tokens included)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True,
               special_as_text: bool = False) -> list[int]:
        """The ids of `text`; with `add_special_tokens` what the post-processor adds (BOS...);
        with `special_as_text` the special tokens spelled in `text` are encoded as the plain
        text they spell. (The batch call: it releases the GIL while it encodes.)"""
        backend = self._as_text if special_as_text else self._backend
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of a text one token stands for (None: no bound holds, see
        `_KEEPING_PRE_TOKENIZERS`); read from tokenizer.json's pipeline and vocabulary."""
        return _max_token_chars(json.loads(self._backend.to_str()),
                                self._backend.get_vocab(with_added_tokens=True))

    def check_fits(self, text: str, max_tokens: int, what: str = "the prompt") -> None:
        """CapacityError, before any encoding, when `text` is too long to be `max_tokens`
        tokens or fewer (when `max_token_chars` bounds it)."""
        span = self.max_token_chars
        if span is not None and len(text) > max_tokens * span:
            raise CapacityError(
                f"{what} has {len(text)} characters, more than {max_tokens} tokens can hold "
                f"(a token of this tokenizer stands for at most {span} characters; the KV "
                f"capacity is {max_tokens}); shorten it")

    @cached_property
    def special_pattern(self) -> re.Pattern | None:
        """A pattern matching the special added tokens' strings, longest first (None: the
        tokenizer has none): what `PromptEncoder` keeps as text in typed content."""
        strings = sorted({token.content for token in
                          self._backend.get_added_tokens_decoder().values() if token.special},
                         key=len, reverse=True)
        return re.compile("|".join(map(re.escape, strings))) if strings else None

    @cached_property
    def _as_text(self) -> Any:
        """A copy of the backend that encodes special tokens as plain text."""
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_str(self._backend.to_str())
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = True
        return backend

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (special tokens dropped with `skip_special_tokens`)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The folder's chat template, compiled on first use (None: it has none)."""
        found = find_chat_template(self.folder, self.config)
        if found is None:
            return None
        source, origin = found
        return ChatTemplate(source, self.special_tokens.template_variables(), origin)

    def compile_template(self, source: str, origin: str) -> ChatTemplate:
        """`source` (a caller's Jinja chat template) compiled in the same sandbox as the
        folder's, with this tokenizer's special tokens; InputError when it does not compile."""
        try:
            return ChatTemplate(source, self.special_tokens.template_variables(), origin)
        except ModelLoadError as error:
            raise InputError(str(error)) from error

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True,
                            max_chars: int | None = None,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            template: ChatTemplate | None = None,
                            variables: Mapping[str, Any] | None = None,
                            continue_final_message: bool = False) -> str:
        """The prompt text of a conversation, through the model's chat template (or
        `template`, a caller's; see `ChatTemplate.render` for the rest); a rendering past
        `max_chars` characters stops there: RenderTooLong."""
        if template is None:
            template = self.chat_template
        if template is None:
            raise InputError(
                f"the model folder {str(self.folder)!r} has no chat template (no "
                f"chat_template.jinja, no chat_template in {TOKENIZER_CONFIG}); pass the prompt "
                "as text instead of messages")
        return template.render(messages, add_generation_prompt=add_generation_prompt,
                               max_chars=max_chars, tools=tools, variables=variables,
                               continue_final_message=continue_final_message)

    def token_id(self, token: str | None) -> int | None:
        """The id of one token string (None when it is not in the vocabulary)."""
        return None if token is None else self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string of one id, as stored (byte-level BPE: 'Ġ' for a space)."""
        return self._backend.id_to_token(int(token_id))

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special added token (what skip_special_tokens drops)."""
        return token_id in self._special_ids

    def added_content(self, token_id: int) -> str | None:
        """The text of an added token (special or not) as declared; None for the others."""
        return self._added.get(int(token_id))


def load_tokenizer(model_path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of the model at `model_path` (a decoder file or its folder)."""
    location = locate_model(model_path)
    return Tokenizer.load(location.folder, location.genai)


# Each runtime's tokenizer, read once and kept while the runtime lives (no reference to it).
_OF_RUNTIME: weakref.WeakKeyDictionary[Runtime, Tokenizer] = weakref.WeakKeyDictionary()
_OF_RUNTIME_LOCK = threading.Lock()


def tokenizer_of(runtime: Runtime) -> Tokenizer:
    """The tokenizer of `runtime`'s model folder (beside its decoder file, with the
    genai_config.json that applies to it), read on first use and kept while the runtime lives;
    ModelLoadError when the folder has none."""
    with _OF_RUNTIME_LOCK:
        tokenizer = _OF_RUNTIME.get(runtime)
        if tokenizer is None:
            tokenizer = _OF_RUNTIME[runtime] = Tokenizer.load(runtime.model_path.parent,
                                                              runtime.genai)
        return tokenizer


def _tokenizer_file(path: Path) -> dict[str, Any]:
    """A tokenizer config file of the folder ({} when absent)."""
    return read_json_object(path, "the tokenizer config",
                            "the tokenizer config transformers writes") or {}


def _token_text(value: object, where: str) -> str | None:
    """A special token as the config stores it: a string or a serialized AddedToken."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(f"{where} must be a token string or an AddedToken object with a "
                         f"\"content\" string, got {value!r}; fix the tokenizer config")


def _special_tokens(config: dict[str, Any], folder: Path) -> SpecialTokens:
    values = dict(config)
    if "added_tokens_decoder" not in config:
        # transformers' legacy path: special_tokens_map.json overrides the config's entries.
        values.update(_tokenizer_file(folder / SPECIAL_TOKENS_MAP))
    where = f"{str(folder / TOKENIZER_CONFIG)!r}"
    return SpecialTokens(**{name: _token_text(values.get(name), f"{where}: {name}")
                            for name in SPECIAL_TOKEN_NAMES})




def _max_token_chars(document: Mapping[str, Any], vocab: Mapping[str, int]) -> int | None:
    """The most characters of a text one token of this tokenizer.json stands for (None: no
    bound holds for its pipeline)."""
    factor = 1
    for normalizer in _pipeline(document.get("normalizer"), "normalizers"):
        kind = normalizer.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            factor = _COMPOSED_CODE_POINTS
        elif kind not in _KEEPING_NORMALIZERS or (kind == "Replace" and not _lengthening(
                normalizer)):
            return None
    for pre_tokenizer in _pipeline(document.get("pre_tokenizer"), "pretokenizers"):
        if pre_tokenizer.get("type") not in _KEEPING_PRE_TOKENIZERS or \
                pre_tokenizer.get("behavior") == "Removed":
            return None
    model = document.get("model") or {}
    kind = model.get("type")
    if kind == "BPE":
        fused = model.get("unk_token") is not None and model.get("fuse_unk")
        if fused and not model.get("byte_fallback"):
            return None
    elif kind != "Unigram" or not model.get("byte_fallback"):
        return None  # WordPiece, WordLevel, Unigram without byte fallback: unknowns fuse
    return factor * max(map(len, vocab), default=1)


def _pipeline(step: Mapping[str, Any] | None, key: str) -> list[Mapping[str, Any]]:
    """The steps of a normalizer or pre-tokenizer (a Sequence's, flattened)."""
    if step is None:
        return []
    if step.get("type") == "Sequence":
        return [inner for part in step.get(key) or [] for inner in _pipeline(part, key)]
    return [step]


def _lengthening(replace: Mapping[str, Any]) -> bool:
    """Whether a Replace normalizer never shortens the text (a string pattern replaced by
    something at least as long)."""
    pattern = (replace.get("pattern") or {}).get("String")
    content = replace.get("content")
    return isinstance(pattern, str) and isinstance(content, str) and \
        len(content) >= len(pattern) > 0


def _rebuild_post_processor(backend: Any, config: dict[str, Any], special: SpecialTokens) -> None:
    """Replace tokenizer.json's post-processor where transformers 5's tokenizer class does."""
    name = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    if name not in _REBUILT_POST_PROCESSORS:
        return
    from tokenizers import processors

    pieces, single, pair = [], "$A:0", "$B:1"
    for wanted, token, role in zip(_REBUILT_POST_PROCESSORS[name],
                                   (special.bos_token, special.eos_token), ("bos", "eos")):
        token_id = None if token is None else backend.token_to_id(token)
        if not wanted or token_id is None:  # transformers adds no token it cannot find
            continue
        pieces.append((token, token_id))
        single = f"{token}:0 {single}" if role == "bos" else f"{single} {token}:0"
        pair = f"{token}:1 {pair}" if role == "bos" else f"{pair} {token}:1"
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} {pair}", special_tokens=pieces)
