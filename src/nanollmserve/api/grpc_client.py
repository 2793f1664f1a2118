"""GrpcClient: a small asyncio client of the gRPC service, for tests, benchmarks
(`nanollmserve bench serve --backend grpc`) and your own code.

    async with await connect("127.0.0.1:50051", api_key=None) as client:  # waits until ready
        reply = await client.generate("Hello", max_tokens=8, temperature=0)
        print(reply.text, reply.completion_tokens, reply.finish_reason)
        async for chunk in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="")
        batch = await client.batch_generate(["a", "b"], max_tokens=4)

Replies are the proto messages of `proto/nanollmserve.proto`. Sampling keywords are the
fields of its SamplingParams (max_tokens, temperature, top_p, top_k, seed, stop, ...);
unset ones keep the server's defaults. Leaving a `stream()` early (break, cancellation)
cancels the call, which aborts the request on the server. Errors raise `grpc.aio.AioRpcError`
(`.code()`, `.details()`). Create the client inside a running event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from nanollmserve.api.grpc_gen import nanollmserve_pb2 as pb
from nanollmserve.api.grpc_gen import nanollmserve_pb2_grpc as pb_grpc

__all__ = ["GrpcClient", "connect", "make_request", "make_sampling_params", "pb"]


def make_sampling_params(**sampling) -> pb.SamplingParams:
    """A SamplingParams message from keywords (`max_tokens=8, temperature=0, stop=[...]`)."""
    return pb.SamplingParams(**sampling)


def make_request(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    request_id: str = "",
    return_token_ids: bool = False,
    **sampling,
) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt or chat messages ({"role", "content"} dicts);
    `return_token_ids`: the reply carries the prompt's and the output's token ids. The
    other keywords are SamplingParams fields (`prompt_logprobs=2`, `priority=-1`, ...)."""
    chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()]
    return pb.GenerateRequest(
        prompt=prompt or "",
        messages=chat,
        sampling=make_sampling_params(**sampling),
        request_id=request_id,
        return_token_ids=return_token_ids,
    )


class GrpcClient:
    def __init__(self, target: str, api_key: str | None = None) -> None:
        """`target` is "host:port"."""
        self.target = target
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def __aenter__(self) -> GrpcClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the channel is connected (TimeoutError after `timeout` seconds)."""
        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def health(self, timeout: float | None = None) -> pb.HealthResponse:
        return await self.stub.Health(pb.HealthRequest(), timeout=timeout, metadata=self.metadata)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling,
    ) -> pb.GenerateResponse:
        request = make_request(prompt, messages=messages, request_id=request_id, **sampling)
        return await self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    async def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling,
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Text deltas as they come; the last message has finish_reason and token counts."""
        request = make_request(prompt, messages=messages, request_id=request_id, **sampling)
        call = self.stub.GenerateStream(request, timeout=timeout, metadata=self.metadata)
        try:
            async for message in call:
                yield message
        finally:
            call.cancel()  # no-op when the call already ended

    async def batch_generate(
        self, prompts: Sequence[str], *, timeout: float | None = None, **sampling
    ) -> pb.BatchGenerateResponse:
        request = pb.BatchGenerateRequest(
            prompts=list(prompts), sampling=make_sampling_params(**sampling)
        )
        return await self.stub.BatchGenerate(request, timeout=timeout, metadata=self.metadata)


async def connect(target: str, api_key: str | None = None, timeout: float = 30.0) -> GrpcClient:
    """A GrpcClient whose channel is connected (TimeoutError after `timeout` seconds)."""
    client = GrpcClient(target, api_key)
    try:
        await client.wait_ready(timeout)
    except BaseException:
        await client.close()
        raise
    return client
