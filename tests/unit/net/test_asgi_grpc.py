"""The gRPC-over-ASGI layer's protocol pieces (the whole path runs in
tests/integration/test_native_grpc.py)."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import grpc
import pytest

from cadence.net.asgi_grpc import (
    AbortError,
    _Call,
    _metadata,
    _wire,
    parse_timeout,
    percent_encode,
)


def _call(max_receive: int = 1 << 10) -> _Call:
    async def make() -> _Call:  # a call belongs to the task that serves it
        return _Call(None, None, max_receive)

    return asyncio.run(make())


@pytest.mark.parametrize(
    ("value", "seconds"), [("1S", 1.0), ("250m", 0.25), ("3M", 180.0), ("99999999n", 0.099999999)]
)
def test_grpc_timeout(value: str, seconds: float) -> None:
    assert parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["", "S", "1s", "123456789S", "-1S", "1.5S"])
def test_a_malformed_grpc_timeout_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="malformed grpc-timeout"):
        parse_timeout(value)


def test_grpc_message_encodes_only_what_the_spec_says() -> None:
    assert percent_encode("50% done: naïve, ok") == b"50%25 done: na%C3%AFve, ok"


def test_binary_metadata_round_trips() -> None:
    wire = _wire((("trace-bin", b"\x00\xff"), ("key", "value")))
    assert _metadata(wire) == (("trace-bin", b"\x00\xff"), ("key", "value"))


def test_an_unknown_encoding_names_the_ones_it_takes() -> None:
    with pytest.raises(AbortError) as info:
        _call().encoding(b"br")
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "gzip, deflate or none" in info.value.details


@pytest.mark.parametrize(
    ("name", "compress"), [(b"gzip", gzip.compress), (b"deflate", zlib.compress)]
)
def test_a_compressed_message_is_inflated_within_the_limit(name: bytes, compress) -> None:
    call = _call(max_receive=1000)
    call.encoding(name)
    assert call._inflate(compress(b"a" * 1000)) == b"a" * 1000
    with pytest.raises(AbortError) as info:  # 1 KiB inflates to 10 MB: refused before that
        call._inflate(compress(b"a" * 10_000_000))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(AbortError) as info:
        call._inflate(b"not compressed")
    assert info.value.code == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("value", [b"!!!notbase64", b"abcde", b"ab!c", b"YQ==="])
def test_binary_metadata_that_is_not_base64_ends_the_call_in_grpcs_words(value: bytes) -> None:
    with pytest.raises(AbortError) as info:
        _metadata([(b"trace-bin", value)])
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert info.value.details == "Error parsing 'trace-bin' metadata: illegal base64 encoding"


def test_binary_metadata_with_or_without_padding_is_read() -> None:
    assert _metadata([(b"a-bin", b"YQ"), (b"b-bin", b"YQ=="), (b"c-bin", b"")]) == (
        ("a-bin", b"a"),
        ("b-bin", b"a"),
        ("c-bin", b""),
    )
