"""The protobuf wire format reader and encoders (onnx_wire), checked against protobuf itself."""

import onnx
import pytest

from onnx_chunk.graph import onnx_wire
from onnx_chunk.graph.onnx_wire import WireError


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32, 2**63 - 1, -1, -(2**63)])
def test_a_varint_reads_back_what_was_written(value):
    encoded = onnx_wire.encode_varint(value)
    read, end = onnx_wire.read_varint(encoded, 0, len(encoded))
    assert onnx_wire.signed64(read) == value and end == len(encoded)


def test_fields_are_what_protobuf_wrote():
    tensor = onnx.TensorProto(name="w", data_type=1, dims=[3, -1], raw_data=b"\0" * 12)
    data = tensor.SerializeToString()
    read = list(onnx_wire.fields(data, 0, len(data)))
    found = {number: (wire, value) for number, wire, value in read}
    assert found[2] == (onnx_wire.VARINT, 1)
    assert onnx_wire.text(data, found[8][1]) == "w"
    dims = [dim for number, wire, value in read if number == 1
            for dim in onnx_wire.packed_varints(data, wire, value)]
    assert [onnx_wire.signed64(dim) for dim in dims] == [3, -1]


def test_unpacked_repeated_integers_read_alike():
    data = onnx_wire.encode_varint_field(1, 3) + onnx_wire.encode_varint_field(1, 5)
    values = [value for _, wire, value in onnx_wire.fields(data, 0, len(data))
              for value in onnx_wire.packed_varints(data, wire, value)]
    assert values == [3, 5]


def test_splicing_a_message_field_by_field_keeps_its_bytes():
    model = onnx.ModelProto(ir_version=9, producer_name="p")
    model.metadata_props.add(key="k", value="v")
    data = model.SerializeToString()
    assert b"".join(onnx_wire.field_bytes(data, *field)
                    for field in onnx_wire.fields(data, 0, len(data))) == data


@pytest.mark.parametrize(("data", "needle"), [
    (b"\x0a\x05ab", "past the end"),           # a LEN field longer than its message
    (b"\x08\x80\x80", "varint runs past"),      # a varint cut short
    (b"\x0b\x0c", "wire type 3"),               # a group
    (b"\x0f", "wire type 7"),
    (b"\x00\x01", "field number 0"),
    (b"\x08" + b"\xff" * 11, "longer than 10 bytes"),
])
def test_malformed_bytes_are_a_wire_error(data, needle):
    with pytest.raises(WireError, match=needle):
        list(onnx_wire.fields(data, 0, len(data)))


def test_a_string_that_is_not_utf8_is_a_wire_error():
    data = b"\x0a\x02\xff\xfe"
    (_, _, span), = onnx_wire.fields(data, 0, len(data))
    with pytest.raises(WireError, match="not UTF-8"):
        onnx_wire.text(data, span)


def test_a_field_of_the_wrong_wire_type_is_a_wire_error():
    varint = onnx_wire.encode_varint_field(4, 7)
    (_, _, value), = onnx_wire.fields(varint, 0, len(varint))
    assert onnx_wire.as_int(value) == 7
    with pytest.raises(WireError, match="length-delimited"):
        onnx_wire.as_span(value)
    string = onnx_wire.encode_len_field(4, "ab")
    (_, _, span), = onnx_wire.fields(string, 0, len(string))
    assert onnx_wire.as_span(span) == (2, 4)
    with pytest.raises(WireError, match="where a varint was expected"):
        onnx_wire.as_int(span)
    with pytest.raises(WireError, match="repeated integer"):
        onnx_wire.packed_varints(string, onnx_wire.I32, span)

