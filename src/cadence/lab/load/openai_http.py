"""The load generator's OpenAI protocol: one request as `POST /v1/completions` or
`/v1/chat/completions` with `stream: true`, to any OpenAI-compatible server (cadence's
`--http-port`, vLLM, SGLang, TGI, llama.cpp's server).

Between two events the hot path only stamps the arrival time and keeps the line's bytes;
the events are parsed after the run (`decode_events`). Per event: `index` and `tokens` from
cadence's own extension (`cadence_timing: true` puts the chunk's position, token count and
server timestamps on every event, so the segments work); from another server, each event
with text is one position (one output), and the last chunk's `usage.completion_tokens` is
kept beside them (`usage_outputs`) for the integrity check to compare with the events, never
spread over them (a spread would hide a duplicated or a missing event); with a tokenizer
(`OpenAITarget.tokenizer`, `--tokenizer`), the output's text is counted in its tokens instead,
spread evenly over the events, and the prompt's text (a chat's messages' contents, without the chat template) in its tokens. A
server that streams reasoning apart from the answer (`delta.reasoning_content`, as vLLM and
SGLang send, or `delta.reasoning`) has both counted as output; the first of each is kept
(`first_reasoning_ns`, `first_answer_ns`). The request asks for usage
(`stream_options.include_usage`). The prompt is text: the planned prompt's token ids as
printable characters, one per token (servers count them with their own tokenizers).

Connect time: a request that opens a new connection records how long the connection took to
make (TCP connect and, over https, the TLS handshake; from aiohttp's connection-create trace)
in `connect_ns`, 0 on a connection already open. It is inside TTFT, and under a burst of new
connections it can be most of it (a dropped SYN costs its client a 1 s retransmit).

Errors: an HTTP status other than 200 is recorded as `HTTP_<status>` with the error's
message; an error event inside a stream as its `code` in upper case (cadence's failure names
are gRPC's codes), else `STREAM_ERROR`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import msgspec

from cadence.lab.load.driver import Driver, Session
from cadence.lab.load.recording import recording, sent, traceparent
from cadence.lab.records import RequestRecord
from cadence.lab.results import OpenAIWorkload

if TYPE_CHECKING:
    import aiohttp

    from cadence.lab.load.plan import RequestPlan
    from cadence.lab.results import Workload

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_FINISH = {"length": 1, "stop": 2}
_decode = msgspec.json.decode


class OpenAITarget(msgspec.Struct, frozen=True, tag="openai"):
    """Which server, model and endpoint to drive."""

    base_url: str
    """`http://HOST:PORT` (or https)."""
    model: str
    endpoint: str = "completions"
    """`completions` or `chat`."""
    token: str = ""
    """A bearer token, sent as `Authorization: Bearer <token>`; empty: none."""
    tokenizer: str = ""
    """A Hugging Face tokenizer folder (its tokenizer.json): another server's output is
    counted in its tokens, not by events or the server's usage; empty: none."""

    CADENCE_SERVER: ClassVar[bool] = False
    HTTP2_SETTINGS: ClassVar[bool] = False
    SERVER_TIMING: ClassVar[bool] = False

    def driver(self) -> OpenAIDriver:
        return OpenAIDriver(self)

    def address(self, target: str) -> str:
        """The server's HOST:PORT, from the base URL (`target` is the URL too)."""
        return self.base_url.split("://", 1)[-1].rstrip("/")

    def describe(self, workload: Workload) -> None:
        workload.model = self.model
        workload.openai = OpenAIWorkload(base_url=self.base_url, endpoint=self.endpoint)


class OpenAIDriver(Driver):
    """HTTP sessions stand for the channels; the session's address is not used (the target
    carries its URL)."""

    def __init__(self, target: OpenAITarget) -> None:
        self.target = target
        self._prompts: dict[str, list[int]] = {}

    async def connect(self, session: Session) -> None:
        self.session = session
        self._clients = [client_session(self.target) for _ in range(session.channels)]
        self._count = token_counter(self.target.tokenizer) if self.target.tokenizer else None
        """Counts text in the --tokenizer's tokens; None: the server's usage counts."""

    async def one(
        self, request: RequestPlan, process: int, lane: int
    ) -> tuple[RequestRecord, list[bytes]]:
        s = self.session
        if self._count is not None:  # its prompt counted after the run, in the tokenizer's tokens
            self._prompts[request.request_id] = request.prompt_token_ids
        return await one_openai(
            self.target,
            self._clients[lane % len(self._clients)],
            request,
            process,
            s.include_timing,
            *s.for_request(request),
            s.stall_s,
        )

    def decode(self, record: RequestRecord, chunks: list[bytes]) -> None:
        count = self._count
        decode_events(record, chunks, self.session.include_timing, count)
        prompt = self._prompts.pop(record.request_id, None)
        if count is not None and prompt is not None:
            record.prompt_tokens = count(prompt_text(prompt))

    async def close(self) -> None:
        for client in self._clients:
            await client.close()


def client_session(target: OpenAITarget) -> aiohttp.ClientSession:
    """One client session (a pool of connections, no limit) for a load process, timing each
    new connection into the record passed as the request's `trace_request_ctx`."""
    import aiohttp

    headers = {"Authorization": f"Bearer {target.token}"} if target.token else None
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), headers=headers, trace_configs=[_connect_timer()]
    )


def _connect_timer() -> aiohttp.TraceConfig:
    import aiohttp

    async def start(_session, context, _params) -> None:
        context.connect_start_ns = time.monotonic_ns()

    async def end(_session, context, _params) -> None:
        record = context.trace_request_ctx
        if record is not None:
            record.connect_ns = time.monotonic_ns() - context.connect_start_ns

    timer = aiohttp.TraceConfig()
    timer.on_connection_create_start.append(start)
    timer.on_connection_create_end.append(end)
    return timer


def require_http(target: OpenAITarget, timeout: float = 5.0) -> None:
    """Raise RuntimeError (one line) when nothing answers HTTP at the target: any status, even
    401 or 404, is an answer."""
    import http.client
    import urllib.error
    import urllib.request

    url = target.base_url + "/v1/models"
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return
    except http.client.HTTPException as exc:  # something answers, but not in HTTP/1.1
        raise RuntimeError(
            f"no HTTP server answers at {target.base_url}: the answer is not "
            f"HTTP/1.1 ({type(exc).__name__}; a gRPC port?)"
        ) from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RuntimeError(f"no HTTP server answers at {target.base_url}: {reason}") from None


def prompt_text(token_ids: list[int]) -> str:
    """The planned prompt as text: one printable ASCII character per token id."""
    return "".join(chr(97 + t % 26) for t in token_ids)


def messages(text: str, parts: list[int]) -> list[dict]:
    """The chat messages of a prompt: one user message, or a conversation's turns (`parts`:
    the messages' lengths, the user's first, then the assistant's and the user's by turns)."""
    if not parts:
        return [{"role": "user", "content": text}]
    out, at = [], 0
    for k, length in enumerate(parts):
        out.append({"role": "assistant" if k % 2 else "user", "content": text[at : at + length]})
        at += length
    return out


def build_body(target: OpenAITarget, plan: RequestPlan, include_timing: bool) -> bytes:
    body: dict = {
        "model": target.model,
        "max_tokens": plan.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    text = prompt_text(plan.prompt_token_ids)
    if target.endpoint == "chat":
        body["messages"] = messages(text, plan.parts)
    else:
        body["prompt"] = text
    if include_timing:
        body["cadence_timing"] = True
    return msgspec.json.encode(body)


async def one_openai(
    target: OpenAITarget,
    client: aiohttp.ClientSession,
    plan: RequestPlan,
    process: int,
    include_timing: bool,
    timeout: float | None,
    read_delay_s: float = 0.0,
    stall_s: float | None = None,
) -> tuple[RequestRecord, list[bytes]]:
    """Send one request, stamp and keep every event; never raises (errors are recorded)."""
    import aiohttp

    url = target.base_url + ENDPOINTS[target.endpoint]
    body = build_body(target, plan, include_timing)
    monotonic_ns = time.monotonic_ns
    record = sent(plan, process)
    record.connect_ns = 0  # unless the connection-create trace sets it
    arrival = record.arrival_ns
    events: list[bytes] = []
    stamp, keep = arrival.append, events.append
    with recording(record, stall_s, plan.cancel_s):
        headers = {
            "Content-Type": "application/json",
            "traceparent": traceparent(record),
            **dict(plan.headers),
        }
        async with client.post(
            url,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
            trace_request_ctx=record,
        ) as response:
            if response.status != 200:
                record.code = f"HTTP_{response.status}"
                record.error = _message(await response.read())
                return record, []
            async for line in response.content:
                if line[:6] == b"data: ":
                    if line[6:12] == b"[DONE]":
                        break
                    stamp(monotonic_ns())
                    keep(line)
                    if read_delay_s:
                        await asyncio.sleep(read_delay_s)
    return record, events


def _message(body: bytes) -> str:
    try:
        return str(_decode(body)["error"]["message"])
    except Exception:
        return body[:200].decode("utf-8", "replace")


def token_counter(folder: str) -> Callable[[str], int]:
    """Counts a text's tokens with the Hugging Face tokenizer in `folder` (its tokenizer.json,
    read with the `tokenizers` library, nothing downloaded); ValueError saying what is
    missing."""
    import os

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            "--tokenizer needs the tokenizers package (pip install tokenizers)"
        ) from None
    path = os.path.join(folder, "tokenizer.json") if os.path.isdir(folder) else folder
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:
        raise ValueError(f"--tokenizer {folder}: cannot read {path}: {exc}") from None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def decode_events(
    record: RequestRecord,
    events: list[bytes],
    include_timing: bool,
    count: Callable[[str], int] | None = None,
) -> None:
    """Fill the record's per-chunk fields from the events `one_openai` kept; `count` (from
    `token_counter`) counts the output's tokens where the server's extension does not."""
    arrivals, kept_arrivals = record.arrival_ns, []
    tokens, index = record.tokens, record.index
    usage_tokens = None
    ours = False
    texts = []
    for at, line in zip(list(arrivals), events, strict=True):
        event = _decode(line[6:])
        if "error" in event:
            error = event["error"] or {}
            code = str(error.get("code") or "").upper()
            record.code = code or "STREAM_ERROR"
            record.error = str(error.get("message", ""))
            continue
        usage = event.get("usage")
        if usage:
            usage_tokens = usage.get("completion_tokens")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                record.cached_tokens = int(cached)
        choices = event.get("choices") or []
        if not choices:
            continue  # the usage chunk
        choice = choices[0]
        if choice.get("finish_reason"):
            record.finish_reason = _FINISH.get(choice["finish_reason"], 1)
        extension = event.get("cadence")
        if extension is not None:
            ours = True
            kept_arrivals.append(at)
            tokens.append(extension["tokens"])
            index.append(extension["index"])
            if include_timing:
                _timing(record, extension)
            continue
        delta = choice.get("delta", choice)
        text = delta.get("content") if "delta" in choice else choice.get("text")
        thought = (
            (delta.get("reasoning_content") or delta.get("reasoning"))
            if "delta" in choice
            else None
        )
        if thought and not record.first_reasoning_ns:
            record.first_reasoning_ns = at
        if text and not record.first_answer_ns:
            record.first_answer_ns = at
        if thought:
            text = thought + (text or "")
        if text:
            kept_arrivals.append(at)
            tokens.append(1)
            index.append(len(index))
            texts.append(text)
    if not record.first_reasoning_ns:
        record.first_answer_ns = 0  # only beside reasoning
    # A usage of no outputs beside text that arrived is a server that does not count them
    # (LitServe's OpenAI spec sends zeros unless the API fills them in), not a count: no
    # server sends text for nothing, so it is no evidence of extra events.
    if not ours and isinstance(usage_tokens, int) and (usage_tokens > 0 or not texts):
        record.usage_outputs = usage_tokens
    counted = count("".join(texts)) if not ours and count is not None and texts else 0
    if counted and counted != len(tokens):  # the tokenizer's count, asked for: per real token
        whole, extra = divmod(counted, len(tokens))
        tokens[:] = [whole + (1 if i < extra else 0) for i in range(len(tokens))]
        index[:] = [0, *itertools.accumulate(tokens[:-1])]
    arrivals[:] = kept_arrivals


def _timing(record: RequestRecord, extension: dict) -> None:
    timing = extension["timing"]
    record.t_step_start_ns.append(timing["step_start_ns"])
    record.t_step_end_ns.append(timing["step_end_ns"])
    record.t_front_recv_ns.append(timing["front_recv_ns"])
    record.t_send_ns.append(timing["send_ns"])
    if extension["index"] == 0:
        record.worker = timing["worker"]
        record.t_received_ns = timing["received_ns"]
        record.t_scheduled_ns = timing["scheduled_ns"]
    if timing.get("handoff_ns"):  # cadence, disaggregated: handed to a decode worker
        record.note_handoff(
            timing["worker"], timing.get("prefill_worker", -1), timing["handoff_ns"]
        )
