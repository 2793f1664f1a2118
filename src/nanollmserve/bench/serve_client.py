"""The clients `nanollmserve bench serve` measures a server through, one timed request each.

`OpenAIBackend` streams `/v1/completions` or `/v1/chat/completions` over httpx (SSE parsed
here, no SDK in the timing path): TTFT is the time to the first chunk with content, ITL the
gaps between content chunks, token counts come from the final `usage` chunk
(`stream_options.include_usage`). A server that sends no usage (llama-cpp-python) gets its
output counts afterwards: max_tokens when the finish reason is "length" (exact, and what
`--ignore-eos` runs end with), else the server re-tokenizes the text (`/tokenize` of ours and
vLLM, `/extras/tokenize/count` of llama-cpp-python; re-tokenizing can merge tokens, ~2% fewer
here), else one token per content chunk; its prompt counts are the intended ones.
With `--endpoint messages` it streams Anthropic's `/v1/messages` (text deltas are the
content chunks; `message_delta` has the usage and the stop reason, max_tokens as "length").
With `--endpoint embeddings` it posts to `/v1/embeddings` instead (no stream: TTFT is E2E, no
output tokens; the prompt count comes from `usage`).
`GrpcBackend` streams the gRPC `GenerateStream` (`nanollmserve serve --grpc-port`); its last
message carries the token counts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from nanollmserve.bench.serve_workloads import ServeRequest


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    """Seconds from sending to the first content."""
    itl: list[float] = field(default_factory=list)
    """Seconds between consecutive content chunks."""
    e2e: float = 0.0
    start: float = 0.0
    """perf_counter() when the request was sent."""
    num_chunks: int = 0
    text: str = ""
    error: str = ""
    finish_reason: str | None = None
    count_source: str = "usage"
    """Where output_tokens came from: usage | length | tokenize | chunks."""

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (vLLM's TPOT)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def server_root(base_url: str) -> str:
    """'http://h:p/v1/' -> 'http://h:p' (the benchmark adds /v1/... itself)."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


ENDPOINT_PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "embeddings": "/v1/embeddings",
    "messages": "/v1/messages",
}


class OpenAIBackend:
    name = "openai"

    def __init__(
        self,
        base_url: str,
        endpoint: str = "completions",
        api_key: str | None = None,
        prompt_format: str = "text",
        extra_body: dict | None = None,
        timeout: float = 600.0,
    ) -> None:
        if endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {endpoint!r}")
        if prompt_format == "ids" and endpoint in ("chat", "messages"):
            raise ValueError("--prompt-format ids needs --endpoint completions")
        self.root = server_root(base_url)
        self.endpoint = endpoint
        self.prompt_format = prompt_format
        self.extra_body = extra_body or {}
        self.model = ""
        self.min_tokens_is_max_tokens = False
        """Send min_tokens = max_tokens (with --ignore-eos: every output is full length)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def fetch_model(self) -> str:
        response = await self.client.get(f"{self.root}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def payload(self, request: ServeRequest) -> dict:
        body: dict = {"model": self.model, "max_tokens": request.max_tokens, "stream": True}
        if self.endpoint != "messages":  # Anthropic's events carry the usage unasked
            body["stream_options"] = {"include_usage": True}
        if self.endpoint in ("chat", "messages"):
            body["messages"] = request.messages()
        elif self.prompt_format == "ids":
            body["prompt"] = request.prompt_token_ids
        else:
            body["prompt"] = request.completion_prompt()
        if self.min_tokens_is_max_tokens:
            body["min_tokens"] = request.max_tokens
        body.update(self.extra_body)
        return body

    async def send(self, request: ServeRequest) -> RequestResult:
        if self.endpoint == "embeddings":
            return await self._embed(request)
        path = ENDPOINT_PATHS[self.endpoint]
        result = RequestResult(count_source="")
        result.start = last = time.perf_counter()
        texts: list[str] = []
        try:
            async with self.client.stream(
                "POST", self.root + path, json=self.payload(request)
            ) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {body[:300]}"
                    return result
                async for line in response.aiter_lines():
                    data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = str(chunk["error"])[:300]
                        return result
                    text = self._content(chunk)
                    if reason := self._finish_reason(chunk):
                        result.finish_reason = reason
                    if text:
                        now = time.perf_counter()
                        if not texts:
                            result.ttft = now - result.start
                        else:
                            result.itl.append(now - last)
                        last = now
                        texts.append(text)
                    usage = chunk.get("usage")
                    if usage and chunk.get("type") != "message_start":  # that has no output
                        result.prompt_tokens = (
                            usage.get("prompt_tokens") or usage.get("input_tokens") or 0
                        )
                        result.output_tokens = (
                            usage.get("completion_tokens") or usage.get("output_tokens") or 0
                        )
                        result.count_source = "usage"
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            return result
        result.e2e = time.perf_counter() - result.start
        if not texts:
            result.ttft = result.e2e
        result.text = "".join(texts)
        result.num_chunks = len(texts)
        result.success = True
        return result

    async def _embed(self, request: ServeRequest) -> RequestResult:
        """One `/v1/embeddings` call: a JSON answer, timed whole."""
        text_or_ids = request.prompt_token_ids if self.prompt_format == "ids" else None
        body = {
            "model": self.model,
            "input": text_or_ids or request.completion_prompt(),
            "encoding_format": "float",
        }
        result = RequestResult()
        result.start = time.perf_counter()
        try:
            response = await self.client.post(self.root + ENDPOINT_PATHS["embeddings"], json=body)
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {response.text[:300]}"
                return result
            reply = response.json()
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            return result
        result.e2e = result.ttft = time.perf_counter() - result.start
        result.prompt_tokens = reply["usage"]["prompt_tokens"]
        result.success = True
        return result

    def _content(self, chunk: dict) -> str:
        if self.endpoint == "messages":  # content_block_delta events with a text_delta
            return (chunk.get("delta") or {}).get("text") or ""
        choices = chunk.get("choices") or []
        if not choices:
            return ""
        if self.endpoint == "chat":
            return (choices[0].get("delta") or {}).get("content") or ""
        return choices[0].get("text") or ""

    def _finish_reason(self, chunk: dict) -> str | None:
        if self.endpoint == "messages":  # message_delta; max_tokens is chat's "length"
            reason = (chunk.get("delta") or {}).get("stop_reason")
            return "length" if reason == "max_tokens" else reason
        return (chunk.get("choices") or [{}])[0].get("finish_reason")

    async def fill_missing_counts(self, requests: list[ServeRequest], results) -> None:
        """Counts for results without usage: a "length" finish means max_tokens tokens;
        otherwise the server re-tokenizes the text, asked after the run (not under load);
        last, one token per content chunk."""
        missing = [(q, r) for q, r in zip(requests, results, strict=True) if r.success]
        missing = [(q, r) for q, r in missing if not r.count_source]
        counter = await self._token_counter() if missing else None
        for request, result in missing:
            if not result.prompt_tokens:
                result.prompt_tokens = request.prompt_len
            if result.finish_reason == "length":
                result.output_tokens, result.count_source = request.max_tokens, "length"
                continue
            count = await counter(result.text) if counter and result.text else None
            if count is None:
                result.output_tokens, result.count_source = result.num_chunks, "chunks"
            else:
                result.output_tokens, result.count_source = count, "tokenize"

    async def _token_counter(self):
        """The first token-count route this server has, as `async text -> int | None`."""

        async def ours(text: str) -> int | None:  # nanollmserve, vLLM
            body = {"model": self.model, "prompt": text}
            response = await self.client.post(f"{self.root}/tokenize", json=body)
            return response.json().get("count") if response.status_code == 200 else None

        async def llama_cpp_python(text: str) -> int | None:
            body = {"model": self.model, "input": text}
            response = await self.client.post(f"{self.root}/extras/tokenize/count", json=body)
            return response.json().get("count") if response.status_code == 200 else None

        for counter in (ours, llama_cpp_python):
            try:
                if await counter("hello world") is not None:
                    return counter
            except (httpx.HTTPError, ValueError):
                continue
        return None

    async def server_stats(self) -> dict | None:
        """nanollmserve's /stats (prefix-cache hits, peak running), None elsewhere."""
        try:
            response = await self.client.get(f"{self.root}/stats")
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None


class GrpcBackend:
    """`GenerateStream` of nanollmserve's gRPC service (text prompts or chat messages)."""

    name = "grpc"

    def __init__(
        self,
        target: str,
        endpoint: str = "completions",
        api_key: str | None = None,
        stats_url: str | None = None,
    ) -> None:
        from nanollmserve.api.grpc_client import GrpcClient

        self.endpoint = endpoint
        self.client = GrpcClient(target, api_key=api_key)
        self.extra: dict = {}
        self.model = ""
        self.api_key = api_key
        self.stats_url = stats_url
        """The HTTP root of the same server, for its /stats (None: no server stats)."""

    async def close(self) -> None:
        await self.client.close()

    async def fetch_model(self) -> str:
        await self.client.wait_ready(30.0)
        return (await self.client.health(timeout=30.0)).model

    async def send(self, request: ServeRequest) -> RequestResult:
        import grpc

        result = RequestResult()
        result.start = last = time.perf_counter()
        kwargs = dict(max_tokens=request.max_tokens, **self.extra)
        if self.endpoint == "chat":
            stream = self.client.stream(messages=request.messages(), **kwargs)
        else:
            stream = self.client.stream(request.completion_prompt(), **kwargs)
        try:
            async for message in stream:
                if message.text:
                    now = time.perf_counter()
                    if not result.num_chunks:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.num_chunks += 1
                result.prompt_tokens = message.prompt_tokens
                result.output_tokens = message.completion_tokens
        except grpc.aio.AioRpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"[:300]
            return result
        result.e2e = time.perf_counter() - result.start
        if not result.num_chunks:
            result.ttft = result.e2e
        result.success = True
        return result

    async def fill_missing_counts(self, requests, results) -> None:
        return None

    async def server_stats(self) -> dict | None:
        if not self.stats_url:
            return None
        http = OpenAIBackend(self.stats_url, api_key=self.api_key)
        try:
            return await http.server_stats()
        finally:
            await http.close()
