"""The per-chunk `ModelStreamInferResponse`, written straight in protobuf's wire format.

Building the response with the protobuf message API costs tens of microseconds per chunk
in Python (a message, a map entry, two output tensors), about twenty times what serializing
a `cadence.v1.GenerateChunk` costs; on the per-token path that is the front's CPU. The
layout of these responses is fixed, so each request's constant part (model name, version,
id) is encoded once and each chunk adds only its tokens and text.
tests/unit/api/test_kserve_responses.py decodes the result with the generated message class
and compares it with one built field by field.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.proto.kserve.tensors import bytes_raw, int32_raw


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SHORT_LENGTHS = tuple(bytes((n,)) for n in range(128))


def _length(n: int) -> bytes:
    return _SHORT_LENGTHS[n] if n < 128 else _varint(n)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, message)."""
    return _varint(number << 3 | 2) + _length(len(payload)) + payload


def _parameter(key: str, value: bytes) -> bytes:
    """One entry of `ModelInferResponse.parameters` (field 4): key and InferParameter."""
    return _field(4, _field(1, key.encode()) + _field(2, value))


def _bool(value: bool) -> bytes:
    return bytes((1 << 3 | 0, int(value)))  # InferParameter.bool_param, a varint


def _int64(value: int) -> bytes:
    return bytes((2 << 3 | 0,)) + _varint(value)  # InferParameter.int64_param (>= 0 here)


def _output(name: str, datatype: str, shape: Sequence[int]) -> bytes:
    """One `outputs` entry (field 5): name, datatype, shape packed."""
    packed = b"".join(_varint(d) for d in shape)
    return _field(5, _field(1, name.encode()) + _field(2, datatype.encode()) + _field(3, packed))


_FINAL = {flag: _parameter("triton_final_response", _bool(flag)) for flag in (False, True)}
FINISH_NAMES = ("length", "stop", "cancelled")
"""Values of the final response's `finish_reason` parameter (cadence's own)."""
_FINISH = {name: _parameter("finish_reason", _field(3, name.encode())) for name in FINISH_NAMES}
_TEXT_OUTPUT = _output("TEXT", "BYTES", (1,))
_ONE_TOKEN_OUTPUT = _output("TOKEN_IDS", "INT32", (1,))
_RESPONSE_TAG = _varint(2 << 3 | 2)
"""ModelStreamInferResponse.infer_response."""
_RAW_TAG = _varint(6 << 3 | 2)
"""ModelInferResponse.raw_output_contents."""


class ResponseEncoder:
    """Encodes the responses of one request of `ModelStreamInfer`."""

    __slots__ = ("_empty_head", "_head", "_want_text", "_want_tokens")

    def __init__(
        self,
        model_name: str,
        model_version: str,
        request_id: str,
        want_tokens: bool,
        want_text: bool,
    ) -> None:
        name, request = _field(1, model_name.encode()), _field(3, request_id.encode())
        self._head = name + _field(2, model_version.encode()) + request
        self._empty_head = name + request
        """The final flag alone carries no version, as Triton sends it."""
        self._want_tokens = want_tokens
        self._want_text = want_text

    def chunk(
        self,
        tokens: Sequence[int],
        text: str,
        finish: str | None,
        cached_tokens: int = 0,
        outputs: int = 0,
    ) -> bytes:
        """A response with the chunk's TOKEN_IDS and TEXT; `finish` (one of FINISH_NAMES)
        marks the request's last response, which carries `cached_tokens` when not 0.
        `outputs`, when not 0, is the parameter of that name: the outputs (stream positions)
        the response covers where they are not one per token id (a model's text pieces)."""
        parts = [self._head, _FINAL[finish is not None]]
        if outputs:
            parts.append(_parameter("outputs", _int64(outputs)))
        if finish is not None:
            parts.append(_FINISH[finish])
            if cached_tokens:
                parts.append(_parameter("cached_tokens", _int64(cached_tokens)))
        raw: list[bytes] = []
        if self._want_tokens:
            parts.append(
                _ONE_TOKEN_OUTPUT
                if len(tokens) == 1
                else _output("TOKEN_IDS", "INT32", (len(tokens),))
            )
            data = int32_raw(tokens)
            raw += (_RAW_TAG, _length(len(data)), data)
        if self._want_text:
            parts.append(_TEXT_OUTPUT)
            data = bytes_raw(text.encode())
            raw += (_RAW_TAG, _length(len(data)), data)
        parts += raw  # each output's raw data in the order of the outputs
        return self._wrap(b"".join(parts))

    def final_only(self, finish: str, cached_tokens: int = 0) -> bytes:
        """The final flag without outputs (the finish came after the last tokens)."""
        cached = _parameter("cached_tokens", _int64(cached_tokens)) if cached_tokens else b""
        return self._wrap(self._empty_head + _FINAL[True] + _FINISH[finish] + cached)

    @staticmethod
    def _wrap(infer_response: bytes) -> bytes:
        return _RESPONSE_TAG + _length(len(infer_response)) + infer_response
