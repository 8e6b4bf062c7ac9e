"""A request body: its JSON decoded, the base of the request models, and the 400 of a body a
request model refused.

`decode_body` reads the JSON (no NaN or Infinity; an object naming one key twice is marked,
so `logit_bias` can refuse a token id named twice); `refusal` turns pydantic's validation
error into the one RequestError a client gets: the first field's deepest error, its `param`
the field's place (inside `messages`: the message, its field, a content part or a call).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from onnx_chunk.serve.messages import (
    CALL_FORM,
    MESSAGE_FORM,
    PART_FORM,
    ChatMessage,
    Refusal,
    surrogate,
)
from onnx_chunk.serve.parameters import unknown_field
from onnx_chunk.serve.protocol import RequestError, shown

_R = TypeVar("_R", bound="RequestModel")


class Repeated(dict):
    """A JSON object that named a key more than once (`repeated`: the first such key)."""

    repeated: str = ""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) == len(pairs):
        return found
    marked = Repeated(found)
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            marked.repeated = key
            break
        seen.add(key)
    return marked


class RequestModel(BaseModel):
    """A request body: strict types, no field it does not declare (`parse` is the one entry;
    a subclass refuses more fields through `_refusable` and `_checked_refusals`)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")
    # The generation endpoint a field of which this one does not know, to name it.
    other: ClassVar[type[RequestModel] | None] = None
    path: ClassVar[str] = ""

    @classmethod
    def parse(cls: type[_R], body: object, *, vocab_size: int | None = None) -> _R:
        """The checked request of a decoded JSON body; RequestError naming the field (see
        the module docstring); `vocab_size`: the model's (token ids at or past it refused)."""
        try:
            return cls.model_validate(body, context={"vocab_size": vocab_size})
        except ValidationError as error:
            raise refusal(error, cls, body) from None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, body: Any) -> Any:
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got {shown(body)}")
        unknown = sorted(name for name in body
                         if name not in cls.model_fields and not cls._refusable(name))
        if unknown:
            name = unknown[0]
            other = cls.other
            raise unknown_field(name, other.path if other is not None
                                and name in other.model_fields else None)
        return cls._checked_refusals(body)

    @classmethod
    def _refusable(cls, name: str) -> bool:
        return False

    @classmethod
    def _checked_refusals(cls, body: dict[str, Any]) -> dict[str, Any]:
        return body



def vocab_size_of(info: ValidationInfo) -> int | None:
    """The model's vocabulary size a validator checks token ids against (None: unchecked)."""
    return (info.context or {}).get("vocab_size")


def _not_json(constant: str) -> object:
    raise ValueError(f"{constant} is not a JSON number")


def decode_body(raw: bytes) -> object:
    """The JSON of a request body; RequestError (`invalid_json`) when it is not JSON (NaN and
    Infinity included), nests too deep or holds an integer of more digits than Python reads."""
    try:
        return json.loads(raw, parse_constant=_not_json, object_pairs_hook=_object)
    except (UnicodeDecodeError, ValueError) as error:
        raise RequestError(f"the request body is not valid JSON ({error}); send a JSON object",
                           code="invalid_json") from error
    except RecursionError as error:
        raise RequestError("the request body nests arrays or objects too deep to be read; "
                           "send a flatter JSON object", code="invalid_json") from error


def refusal(error: ValidationError, model: type[BaseModel], body: object) -> RequestError:
    """The RequestError of a body the model refused: its first field's deepest error."""
    details = error.errors(include_url=False)
    first = details[0]["loc"][:1]
    detail = max((detail for detail in details if detail["loc"][:1] == first), key=_rank)
    cause = (detail.get("ctx") or {}).get("error")
    if isinstance(cause, RequestError):
        return cause
    if not detail["loc"] or not isinstance(body, dict):
        return RequestError(f"the request body is not valid: {detail['msg']}")
    param, value, expected = _place(model, detail["loc"], body)
    if detail["type"] == "string_unicode":  # pydantic's own check of a constrained string
        text = detail["input"]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as unicode_error:
            cause = surrogate(text, unicode_error)
    if isinstance(cause, Refusal):
        return cause.error(param)
    return RequestError(f"'{param}' must be {expected}, got {shown(value)}", param=param)


def _rank(detail: Any) -> tuple[bool, int]:
    """Which of a field's errors a refusal tells: a refusal of the value itself (a lone
    surrogate, a rule) before a type that did not match, then the deepest."""
    cause = (detail.get("ctx") or {}).get("error")
    return (detail["type"] == "string_unicode" or isinstance(cause, (Refusal, RequestError)),
            len(detail["loc"]))


def _place(model: type[BaseModel], loc: tuple[int | str, ...], body: dict[str, Any]
           ) -> tuple[str, object, str]:
    """Where an error is (its `param`), the value there and what it must be: a field of the
    body, or inside `messages`: a message, its field, or one of its content parts or calls
    (the union members pydantic names in `loc` skipped)."""
    name = str(loc[0])
    value = body.get(name)
    expected = model.model_fields[name].description if name in model.model_fields else None
    if name != "messages" or len(loc) < 2 or not isinstance(value, list):
        return name, value, expected or "valid"
    index = int(loc[1])
    message, param = value[index], f"messages[{index}]"
    if len(loc) < 3 or not isinstance(message, dict):
        return param, message, MESSAGE_FORM
    field = str(loc[2])
    param, value = f"{param}.{field}", message.get(field)
    items = [key for key in loc[3:] if isinstance(key, int)]
    if field in ("content", "tool_calls") and items and isinstance(value, list):
        return (f"{param}[{items[0]}]", value[items[0]],
                PART_FORM if field == "content" else CALL_FORM)
    described = ChatMessage.model_fields.get(field)
    return param, value, (described.description if described else None) or "valid"
