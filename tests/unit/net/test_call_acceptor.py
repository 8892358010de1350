"""The call acceptor on a real grpc.aio server (127.0.0.1): calls requested ahead reach their
handler through grpc.aio's own path, interceptors included, and shutdown leaves nothing."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cadence.net.call_acceptor import CallAcceptor, supported

_METHOD = "/test.Echo/Stream"


async def _stream(request: bytes, context: grpc.aio.ServicerContext):
    for i in range(3):
        yield request + bytes([i])


class _RequireKey(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        if ("key", "yes") in (details.invocation_metadata or ()):
            return await continuation(details)

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no key")

        return grpc.unary_stream_rpc_method_handler(refuse)


async def _serve(interceptors=(), depth: int = 4):
    server = grpc.aio.server(interceptors=list(interceptors))
    handler = grpc.unary_stream_rpc_method_handler(_stream)
    server.add_registered_method_handlers("test.Echo", {"Stream": handler})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    acceptor = CallAcceptor(server, {_METHOD: handler}, interceptors, depth)
    return server, acceptor, port


def test_this_grpcio_is_supported() -> None:
    """The installed grpcio has the internals the acceptor needs (else it would do nothing)."""

    async def main() -> bool:
        server, _, _ = await _serve()
        try:
            return supported(server)
        finally:
            await server.stop(None)

    assert asyncio.run(main())


def test_a_server_without_those_internals_is_left_alone() -> None:
    class Other:
        class _server:
            @staticmethod
            async def _request_registered_call(method, extra):  # another signature
                return None

    assert not supported(object())
    assert not supported(Other())


def test_calls_requested_ahead_are_served_whole() -> None:
    async def main() -> tuple[list[list[bytes]], int]:
        server, acceptor, port = await _serve(depth=4)
        assert acceptor.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(_METHOD)
            results = await asyncio.gather(*(_read(call(b"%d" % i)) for i in range(40)))
        await server.stop(1.0)
        acceptor.close()
        return results, acceptor.accepted

    results, accepted = asyncio.run(main())
    assert results == [[b"%d" % i + bytes([k]) for k in range(3)] for i in range(40)]
    assert accepted > 0, "no call came through the acceptor's requests"


def test_interceptors_run_on_calls_the_acceptor_took() -> None:
    async def main() -> tuple[list[grpc.StatusCode], int, list[bytes]]:
        server, acceptor, port = await _serve(interceptors=(_RequireKey(),), depth=8)
        assert acceptor.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(_METHOD)
            codes = []
            for _ in range(20):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _read(call(b"x"))
                codes.append(info.value.code())
            allowed = await _read(call(b"y", metadata=(("key", "yes"),)))
        await server.stop(1.0)
        acceptor.close()
        return codes, acceptor.accepted, allowed

    codes, accepted, allowed = asyncio.run(main())
    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
    assert accepted > 0
    assert allowed == [b"y\x00", b"y\x01", b"y\x02"]


def test_depth_zero_leaves_grpc_aio_alone() -> None:
    async def main() -> bool:
        server, acceptor, port = await _serve(depth=0)
        started = acceptor.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert len(await _read(channel.unary_stream(_METHOD)(b"z"))) == 3
        await server.stop(None)
        return started

    assert asyncio.run(main()) is False


async def _read(call) -> list[bytes]:
    return [message async for message in call]
