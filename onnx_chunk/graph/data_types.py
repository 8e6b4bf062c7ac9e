"""ONNX's tensor element types (TensorProto.DataType): their names, widths and numpy dtypes."""

from __future__ import annotations

import math

import numpy as np

# TensorProto.DataType -> (name, bits per element (None: no fixed width), numpy dtype name;
# the names numpy lacks are ml_dtypes', as onnx_ir maps them).
DATA_TYPES: dict[int, tuple[str, int | None, str]] = {
    1: ("FLOAT", 32, "float32"), 2: ("UINT8", 8, "uint8"), 3: ("INT8", 8, "int8"),
    4: ("UINT16", 16, "uint16"), 5: ("INT16", 16, "int16"), 6: ("INT32", 32, "int32"),
    7: ("INT64", 64, "int64"), 8: ("STRING", None, "object"), 9: ("BOOL", 8, "bool"),
    10: ("FLOAT16", 16, "float16"), 11: ("DOUBLE", 64, "float64"),
    12: ("UINT32", 32, "uint32"), 13: ("UINT64", 64, "uint64"),
    14: ("COMPLEX64", 64, "complex64"), 15: ("COMPLEX128", 128, "complex128"),
    16: ("BFLOAT16", 16, "bfloat16"), 17: ("FLOAT8E4M3FN", 8, "float8_e4m3fn"),
    18: ("FLOAT8E4M3FNUZ", 8, "float8_e4m3fnuz"), 19: ("FLOAT8E5M2", 8, "float8_e5m2"),
    20: ("FLOAT8E5M2FNUZ", 8, "float8_e5m2fnuz"), 21: ("UINT4", 4, "uint4"),
    22: ("INT4", 4, "int4"), 23: ("FLOAT4E2M1", 4, "float4_e2m1fn"),
    24: ("FLOAT8E8M0", 8, "float8_e8m0fnu"), 25: ("UINT2", 2, "uint2"), 26: ("INT2", 2, "int2"),
}


def tensor_nbytes(data_type: int, dims: tuple[int, ...]) -> int | None:
    """The bytes a tensor's data takes by its dtype and shape (4-bit types packed two a byte).

    None for types without a fixed width (strings) and unknown types.
    """
    bits = DATA_TYPES.get(data_type, ("", None, ""))[1]
    if bits is None:
        return None
    return (math.prod(dims) * bits + 7) // 8


def data_type_name(data_type: int) -> str:
    """TensorProto.DataType's name of `data_type`."""
    return DATA_TYPES.get(data_type, (f"data type {data_type}", None, ""))[0]


def numpy_dtype(data_type: int) -> np.dtype:
    """The numpy dtype of a TensorProto.DataType (ml_dtypes' for the types numpy lacks);
    ValueError for an unknown one."""
    if data_type not in DATA_TYPES:
        raise ValueError(f"unknown ONNX data type {data_type}")
    name = DATA_TYPES[data_type][2]
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
