"""Python clients for `cadence.v1.Inference`: `Client` (blocking) and `AsyncClient` (asyncio)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Self

from grpc_health.v1 import health_pb2, health_pb2_grpc

from cadence.credentials import ClientCredentials
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc

GenerateChunk = pb.GenerateChunk
FinishReason = pb.FinishReason


def build_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 64,
    request_id: str = "",
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    include_timing: bool = False,
    priority: int = 0,
) -> pb.GenerateRequest:
    """A GenerateRequest; `prompt` is text or a list of token ids; `priority`: lower is
    served first."""
    request = pb.GenerateRequest(
        request_id=request_id,
        max_tokens=max_tokens,
        stop_token_ids=list(stop_token_ids),
        include_timing=include_timing,
        priority=priority,
        sampling=pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


class AsyncClient:
    """An asyncio client. Use as `async with AsyncClient("127.0.0.1:50051") as client:`.

    `credentials` (TLS, client certificate, bearer token) are for a server started with
    them; the default is a plaintext channel.
    """

    def __init__(self, target: str, *, credentials: ClientCredentials | None = None) -> None:
        self._channel = (credentials or ClientCredentials()).aio_channel(target)
        self._stub = pb_grpc.InferenceStub(self._channel)

    async def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options
    ) -> AsyncIterator[pb.GenerateChunk]:
        """Stream the chunks of one request; `options` are those of `build_request`.

        Leaving the loop early cancels the request on the server.
        """
        call = self._stub.Generate(build_request(prompt, **options), timeout=timeout)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def health(self, service: str = "") -> str:
        """The server's health status name: SERVING, NOT_SERVING, ..."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Client:
    """A blocking client. Use as `with Client("127.0.0.1:50051") as client:`.

    `credentials` (TLS, client certificate, bearer token) are for a server started with
    them; the default is a plaintext channel.
    """

    def __init__(self, target: str, *, credentials: ClientCredentials | None = None) -> None:
        self._channel = (credentials or ClientCredentials()).channel(target)
        self._stub = pb_grpc.InferenceStub(self._channel)

    def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options
    ) -> Iterator[pb.GenerateChunk]:
        """Stream the chunks of one request; `options` are those of `build_request`.

        Leaving the loop early cancels the request on the server.
        """
        call = self._stub.Generate(build_request(prompt, **options), timeout=timeout)
        try:
            yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | Sequence[int], **options) -> str:
        """The whole generated text of one request."""
        return "".join(chunk.text for chunk in self.generate(prompt, **options))

    def health(self, service: str = "") -> str:
        """The server's health status name: SERVING, NOT_SERVING, ..."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
