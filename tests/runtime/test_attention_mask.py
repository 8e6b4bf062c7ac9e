"""The two mask policies: a prefix of ones bound per forward, or a capacity-wide mask
rewritten in place, column by column."""

import dataclasses

import numpy as np
import pytest

from onnx_chunk.runtime.device.buffers import DeviceBuffer, copy_on_device, zero_range
from onnx_chunk.runtime.device.provider import MaskPolicy, device_for
from onnx_chunk.runtime.runner.attention_mask import (
    CapacityMask,
    LogicalMask,
    decode_mask,
    mask_kind,
)
from onnx_chunk.runtime.state.ports import MASK_INPUT


class _Binding:
    """What a mask binds: (name, shape, address) per bind_input, the OrtValue per bind."""

    def __init__(self):
        self.inputs, self.values = [], []

    def bind_input(self, name, device_type, device_id, dtype, shape, address):
        self.inputs.append((name, tuple(shape), address))

    def bind_ortvalue_input(self, name, value):
        self.values.append((name, value))


@pytest.fixture(params=[True, False], ids=["host", "device"])
def device(request):
    return dataclasses.replace(device_for("cpu"), host_visible=request.param)


@pytest.fixture
def written(monkeypatch):
    """The flat [start, stop) ranges written into any device buffer."""
    ranges = []
    original = DeviceBuffer.write_range

    def write_range(self, array, start, stop):
        ranges.append((start, stop))
        return original(self, array, start, stop)

    monkeypatch.setattr(DeviceBuffer, "write_range", write_range)
    return ranges


def _contents(mask):
    return mask.buffer.read(0, mask.rows * mask.capacity).reshape(mask.rows, mask.capacity)


def test_the_policy_is_chosen_by_name():
    assert mask_kind(MaskPolicy.LOGICAL) is LogicalMask
    assert mask_kind("capacity") is CapacityMask


def test_the_logical_mask_binds_a_prefix_of_ones_and_writes_nothing(device, written):
    mask = LogicalMask(1, 10, np.int64, device)
    io = _Binding()
    mask.bind(io)
    assert io.values == [] and io.inputs == []
    for end in (7, 8, 3):
        mask.set(io, end)
    address = mask.buffer.value.data_ptr()
    assert io.inputs == [(MASK_INPUT, (1, end), address) for end in (7, 8, 3)]
    assert written == [] and _contents(mask).all()
    mask.reset()
    assert _contents(mask).all()


@pytest.mark.parametrize("ends", [[3, 7, 8], [10], [1, 2, 3, 4]])
def test_the_capacity_mask_is_bound_once_and_rewritten_in_place(device, ends):
    mask = CapacityMask(1, 10, np.int64, device)
    io = _Binding()
    mask.bind(io)
    assert io.values == [(MASK_INPUT, mask.buffer.value)]
    for end in ends:
        mask.set(io, end)
        row = _contents(mask)[0]
        assert row[:end].all() and not row[end:].any()
    assert io.inputs == []


@pytest.fixture
def changed(monkeypatch):
    """The flat ranges a capacity mask sets to ones or zeros on the device."""
    ranges = []
    from onnx_chunk.runtime.runner import attention_mask

    def ones(target, start, source, source_start, count):
        ranges.append(("ones", start, start + count))
        return copy_on_device(target, start, source, source_start, count)

    def zeros(buffer, start, stop):
        ranges.append(("zeros", start, stop))
        return zero_range(buffer, start, stop)

    monkeypatch.setattr(attention_mask, "copy_on_device", ones)
    monkeypatch.setattr(attention_mask, "zero_range", zeros)
    return ranges


def test_the_capacity_mask_changes_only_the_columns_that_change(device, written, changed):
    mask = CapacityMask(1, 10, np.int64, device)
    written.clear()  # its row of ones, written once
    before = device.transfers.snapshot()
    io = _Binding()
    mask.set(io, 4)
    mask.set(io, 5)  # a decode step: one column
    mask.set(io, 2)  # after a rewind: the columns past the new end are cleared
    assert changed == [("ones", 0, 4), ("ones", 4, 5), ("zeros", 2, 5)]
    assert _contents(mask).tolist() == [[1, 1, 0, 0, 0, 0, 0, 0, 0, 0]]
    mask.reset()
    assert not _contents(mask).any()
    changed.clear()
    mask.set(io, 3)
    assert changed == [("ones", 0, 3)]
    # Nothing crossed from the host (the reads above are the test's own).
    assert written == [] and device.transfers.snapshot().host_to_device_bytes == (
        before.host_to_device_bytes)


def test_a_batched_step_changes_one_column_per_row_that_stepped(device, changed):
    mask = CapacityMask(3, 8, np.int64, device)
    mask.set_rows(_Binding(), [2, 0, 4])
    changed.clear()
    mask.set_rows(_Binding(), [3, 0, 5])  # rows 0 and 2 stepped, row 1 stayed idle
    assert changed == [("ones", 3, 4), ("ones", 21, 22)]
    assert np.array_equal(_contents(mask), decode_mask([3, 0, 5], 8, np.int64))


def test_a_batched_decode_step_gives_each_row_its_own_length(device):
    lengths = [0, 3, 1]
    logical, capacity = LogicalMask(3, 8, np.int64, device), CapacityMask(3, 8, np.int64, device)
    logical_io, capacity_io = _Binding(), _Binding()
    capacity.bind(capacity_io)
    logical.set_rows(logical_io, lengths)
    capacity.set_rows(capacity_io, lengths)
    assert logical_io.inputs == [(MASK_INPUT, (3, 4), logical.buffer.value.data_ptr())]
    assert capacity_io.inputs == [] and len(capacity_io.values) == 1
    flat = logical.buffer.read(0, 12).reshape(3, 4)
    assert np.array_equal(flat, decode_mask(lengths, 4, np.int64))
    assert np.array_equal(_contents(capacity), decode_mask(lengths, 8, np.int64))
