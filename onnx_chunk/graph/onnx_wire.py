"""The protobuf wire format, as far as reading and lightly editing an ONNX file needs it.

Loading a converted model needs a few fields of its protobuf (metadata, graph inputs and
outputs, the external data index) and none of its weights; this reads them from the file's
bytes (a memory map) without `onnx` or `google.protobuf`, which a lean load does not import.

Rules:
1. A message is a sequence of fields; `fields` yields each as (number, wire type, value): an
   int for VARINT, the (start, end) span of its bytes for LEN, I64 and I32 (read by the caller
   if it needs them). Groups (wire types 3 and 4, unused by ONNX) and unknown wire types are
   WireError, as is any field or varint that runs past its message.
2. Repeated scalar fields may come packed (one LEN field) or not: `packed_varints` reads both.
3. The encoders write what they are given and nothing else; a message edited by splicing keeps
   every other field's bytes as they were (unknown fields included).
"""

from __future__ import annotations

from collections.abc import Iterator

VARINT = 0
I64 = 1
LEN = 2
I32 = 5

_MASK64 = (1 << 64) - 1


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message (say where and why)."""


Span = tuple[int, int]


def read_varint(data, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError(f"a varint runs past the end of its message at byte {pos}")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError(f"a varint longer than 10 bytes ends at byte {pos}")


def fields(data, start: int, end: int) -> Iterator[tuple[int, int, int | Span]]:
    """Every field of the message in `data[start:end]`: (number, wire type, value or span)."""
    pos = start
    while pos < end:
        key, pos = read_varint(data, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError(f"field number 0 at byte {pos}")
        if wire == VARINT:
            value, pos = read_varint(data, pos, end)
            yield number, wire, value
            continue
        if wire == LEN:
            size, pos = read_varint(data, pos, end)
            stop = pos + size
        elif wire == I64:
            stop = pos + 8
        elif wire == I32:
            stop = pos + 4
        else:
            raise WireError(f"wire type {wire} of field {number} at byte {pos} (groups and "
                            "unknown types are not ONNX)")
        if stop > end:
            raise WireError(f"field {number} runs to byte {stop}, past the end of its message "
                            f"at byte {end}")
        yield number, wire, (pos, stop)
        pos = stop


def as_span(value: int | Span) -> Span:
    """The span `fields` yields for a LEN, I64 or I32 field; WireError for a VARINT's int (a
    field of the wrong wire type where the caller did not check it)."""
    if isinstance(value, int):
        raise WireError("a varint where a length-delimited field was expected")
    return value


def as_int(value: int | Span) -> int:
    """The int `fields` yields for a VARINT field; WireError for a span."""
    if not isinstance(value, int):
        raise WireError(f"a field of bytes {value[0]}-{value[1]} where a varint was expected")
    return value


def signed64(value: int) -> int:
    """An int64 field's value (varints carry it in two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def packed_varints(data, wire: int, value: int | Span) -> list[int]:
    """The values of one occurrence of a repeated varint field, packed or not."""
    if wire == VARINT:
        return [as_int(value)]
    if wire != LEN:
        raise WireError(f"a repeated integer field has wire type {wire}")
    start, end = as_span(value)
    values = []
    while start < end:
        number, start = read_varint(data, start, end)
        values.append(number)
    return values


def text(data, span: Span) -> str:
    """A string field's value (UTF-8)."""
    try:
        return bytes(data[span[0]:span[1]]).decode("utf-8")
    except UnicodeDecodeError as error:
        raise WireError(f"a string field at byte {span[0]} is not UTF-8 ({error})") from error


def encode_varint(value: int) -> bytes:
    """`value` (negative: as int64) as a varint."""
    value &= _MASK64
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_varint_field(number: int, value: int) -> bytes:
    """One VARINT field."""
    return encode_varint(number << 3 | VARINT) + encode_varint(value)


def encode_len_field(number: int, payload: bytes | str) -> bytes:
    """One LEN field (a string is written as UTF-8)."""
    raw = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
    return encode_varint(number << 3 | LEN) + encode_varint(len(raw)) + raw


def field_bytes(data, number: int, wire: int, value: int | Span) -> bytes:
    """One field as read by `fields`, written back unchanged."""
    if wire == VARINT:
        return encode_varint_field(number, as_int(value))
    start, end = as_span(value)
    if wire == LEN:
        return encode_len_field(number, bytes(data[start:end]))
    return encode_varint(number << 3 | wire) + bytes(data[start:end])


def len_header(number: int, size: int) -> bytes:
    """The tag and length of a LEN field whose payload of `size` bytes follows."""
    return encode_varint(number << 3 | LEN) + encode_varint(size)


def field_pieces(view: memoryview, number: int, wire: int, value: int | Span) -> list:
    """`field_bytes` as pieces to join later: a small header and a view of the payload, so a
    large field (a weight) is copied once, by the final join."""
    if wire == VARINT:
        return [encode_varint_field(number, as_int(value))]
    start, end = as_span(value)
    header = len_header(number, end - start) if wire == LEN else encode_varint(number << 3 | wire)
    return [header, view[start:end]]


def string_field(data, span: Span, number: int) -> str | None:
    """The first string field `number` of the message at `span`, or None."""
    for field, wire, value in fields(data, *span):
        if field == number and wire == LEN:
            return text(data, as_span(value))
    return None

