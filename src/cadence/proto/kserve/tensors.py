"""Tensor data of the Open Inference Protocol: reading request inputs, writing outputs.

A tensor's elements travel either as typed lists (`InferTensorContents`) or as raw
little-endian bytes in the message's `raw_input_contents` / `raw_output_contents`, one entry
per tensor in order. A BYTES element is a 4-byte little-endian length and that many bytes.
tritonclient and Triton itself send raw contents; both forms are read here, and outputs are
always written raw, as Triton does.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Sequence

from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.wording import counted


class TensorError(ValueError):
    """An input tensor whose data does not match its datatype and shape."""


_ARRAY_CODES = {
    "BOOL": "B",
    "INT8": "b",
    "UINT8": "B",
    "INT16": "h",
    "UINT16": "H",
    "INT32": "i",
    "UINT32": "I",
    "INT64": "q",
    "UINT64": "Q",
    "FP32": "f",
    "FP64": "d",
}
"""Python `array` type codes of the fixed-size datatypes (sizes checked at import below)."""

_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "INT64": "int64_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

INTEGER_TYPES = frozenset(
    ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
)
FLOAT_TYPES = frozenset(("FP32", "FP64"))

_LITTLE_ENDIAN = sys.byteorder == "little"
_LENGTH = struct.Struct("<I")

assert all(
    array(code).itemsize == size
    for code, size in (("b", 1), ("h", 2), ("i", 4), ("q", 8), ("f", 4), ("d", 8))
)


def element_count(shape: list[int]) -> int:
    """Elements of a tensor of `shape` (a scalar, shape [], has one)."""
    return math.prod(shape)


def decode_input(tensor: kpb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> list:
    """The tensor's elements, flattened: ints, floats, or bytes for BYTES.

    `raw` is the tensor's entry of `raw_input_contents`, or None when the request carries
    its data in `contents`. Raises TensorError when the data does not fit the shape.
    """
    datatype, name = tensor.datatype, tensor.name
    if any(d < 0 for d in tensor.shape):
        raise TensorError(f"input {name!r} has a negative dimension in shape {list(tensor.shape)}")
    count = element_count(tensor.shape)
    if raw is None:
        field = _CONTENTS_FIELD.get(datatype)
        if field is None:
            raise TensorError(
                f"input {name!r} has datatype {datatype!r}, which cadence does not read"
            )
        values = list(getattr(tensor.contents, field))
    elif datatype == "BYTES":
        values = _split_bytes(raw, name)
    else:
        code = _ARRAY_CODES.get(datatype)
        if code is None:
            raise TensorError(
                f"input {name!r} has datatype {datatype!r}, which cadence does not read"
            )
        elements = array(code)
        if len(raw) % elements.itemsize:
            raise TensorError(
                f"input {name!r}: {counted(len(raw), 'byte')} of raw data is not a whole "
                f"number of {datatype} elements"
            )
        elements.frombytes(raw)
        if not _LITTLE_ENDIAN:
            elements.byteswap()
        values = elements.tolist()
    if len(values) != count:
        raise TensorError(
            f"input {name!r} has shape {list(tensor.shape)} ({count} elements) "
            f"but carries {len(values)}"
        )
    return values


def _split_bytes(raw: bytes, name: str) -> list[bytes]:
    """BYTES elements from raw data: each a 4-byte little-endian length, then the bytes."""
    out, at, end = [], 0, len(raw)
    while at < end:
        if at + 4 > end:
            raise TensorError(f"input {name!r}: raw BYTES data ends inside an element's length")
        (length,) = _LENGTH.unpack_from(raw, at)
        at += 4
        if at + length > end:
            raise TensorError(f"input {name!r}: a raw BYTES element runs past the data")
        out.append(raw[at : at + length])
        at += length
    return out


_ONE_INT32 = struct.Struct("<i").pack


def int32_raw(values: Sequence[int]) -> bytes:
    """Raw little-endian INT32 data."""
    if len(values) == 1:  # the common chunk: one token
        return _ONE_INT32(values[0])
    data = array("i", values)
    if not _LITTLE_ENDIAN:
        data.byteswap()
    return data.tobytes()


def bytes_raw(element: bytes) -> bytes:
    """Raw data of a BYTES tensor of one element."""
    return _LENGTH.pack(len(element)) + element
