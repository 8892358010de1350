"""The OpenAI wire, without HTTP: a request body to the core's `Request`, each `Chunk` to the
bytes of one Server-Sent Event (or to a whole response), stop strings.

Fields read (docs/openai.md): `model`, `prompt` (completions: a string, one string in a list,
or token ids) or `messages` (chat), `max_tokens` / `max_completion_tokens`, `temperature`,
`top_p`, `seed`, `stop` (a string or up to 4), `stop_token_ids`, `n` (1 only), `stream`,
`stream_options.include_usage`, `priority` (vLLM's: an integer, lower served first, default 0); `user` and fields cadence does not use are ignored. Two
extension fields of cadence's own: `cadence_timing` (server timestamps on every chunk, for the
lab's segments) and `cadence_timeout_s` (a deadline: 504 once it passes).

Streamed events are built from bytes that are fixed per request (id, object, created, model,
the choice's frame) and the chunk's own text, encoded with msgspec: the per-chunk work is one
string encode and one join.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from cadence.api.errors import http_status
from cadence.core.errors import InvalidRequest, RequestError
from cadence.core.requests import (
    PRIORITY_RANGE,
    SEED_RANGE,
    TOKEN_ID_MAX,
    Chunk,
    ChunkTiming,
    Request,
)
from cadence.vocabulary import Failure, Finish, Sampling

COMPLETIONS = "completions"
CHAT = "chat"
DONE = b"data: [DONE]\n\n"
DEFAULT_COMPLETION_TOKENS = 16
"""`max_tokens` of a completion that gives none (OpenAI's documented default)."""
_MAX_STOPS = 4

FINISH_REASON: dict[int, str] = {Finish.LENGTH: "length", Finish.STOP: "stop"}

_encode = msgspec.json.Encoder().encode
_decode_body = msgspec.json.Decoder().decode


class OpenAIRequest(msgspec.Struct, kw_only=True):
    """A parsed request: the core's `Request` and what only the OpenAI wire needs."""

    endpoint: str
    model: str
    request: Request
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = []
    messages: list[dict[str, str]] = []
    """Chat: the messages (role and text), rendered into `request.prompt` by a ChatTemplate."""
    timeout_s: float | None = None


def parse(body: bytes, endpoint: str, *, default_max_tokens: int) -> OpenAIRequest:
    """A request body of `endpoint` (COMPLETIONS or CHAT); raise InvalidRequest naming the
    field (`parameter`, as the body names it)."""
    try:
        data = _decode_body(body) if body else None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's guard against a nesting bomb: refused, not a 500
        raise InvalidRequest(
            "the request body nests arrays or objects too deeply; no field "
            "of a request nests more than a few levels"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required: the name GET /v1/models lists", "model")
    n = data.get("n", 1)
    if n not in (1, None):
        raise InvalidRequest("n must be 1: this server returns one choice per request", "n")
    request = Request(
        max_tokens=_max_tokens(data, endpoint, default_max_tokens),
        sampling=Sampling(
            temperature=_number(data, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(data, "top_p", 1.0, 0.0, 1.0),
            seed=_integer(data, "seed", 0, *SEED_RANGE),
            stop_token_ids=tuple(_token_ids(data, "stop_token_ids", required=False)),
        ),
        include_timing=_boolean(data, "cadence_timing"),
        priority=_integer(data, "priority", 0, *PRIORITY_RANGE),
    )
    out = OpenAIRequest(
        endpoint=endpoint,
        model=model,
        request=request,
        stream=_boolean(data, "stream"),
        stops=_stops(data),
    )
    options = data.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object", "stream_options")
        out.include_usage = _boolean(options, "include_usage", "stream_options.include_usage")
    timeout = data.get("cadence_timeout_s")
    if timeout is not None:
        if not _is_number(timeout) or timeout <= 0:
            raise InvalidRequest(
                "cadence_timeout_s must be a positive number of seconds", "cadence_timeout_s"
            )
        out.timeout_s = float(timeout)
    if endpoint == CHAT:
        out.messages = _messages(data)
    else:
        _prompt(data, request)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(data: dict, name: str, default: float, low: float, high: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be a number from {low:g} to {high:g}", name)
    return float(value)


def _integer(data: dict, name: str, default: int, low: int, high: int) -> int:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequest(f"{name} must be an integer from {low} to {high}", name)
    return value


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= TOKEN_ID_MAX


def _boolean(data: dict, name: str, param: str | None = None) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{param or name} must be true or false", param or name)
    return value


def _max_tokens(data: dict, endpoint: str, default: int) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = data.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequest(f"{name} must be an integer of at least 1", name)
            return value
    return DEFAULT_COMPLETION_TOKENS if endpoint == COMPLETIONS else default


def _token_ids(data: dict, name: str, *, required: bool) -> list[int]:
    value = data.get(name)
    if value is None and not required:
        return []
    if not isinstance(value, list) or not all(map(_is_token_id, value)):
        raise InvalidRequest(
            f"{name} must be a list of token ids (integers from 0 to {TOKEN_ID_MAX})", name
        )
    return value


def _stops(data: dict) -> list[str]:
    value = data.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, list)
        or len(value) > _MAX_STOPS
        or not all(isinstance(s, str) and s for s in value)
    ):
        raise InvalidRequest(
            f"stop must be a non-empty string or a list of up to {_MAX_STOPS} of them", "stop"
        )
    return value


def _prompt(data: dict, request: Request) -> None:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        request.prompt = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if not all(map(_is_token_id, prompt)):
            raise InvalidRequest(
                f"prompt token ids must be integers from 0 to {TOKEN_ID_MAX}", "prompt"
            )
        request.prompt_token_ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise InvalidRequest(
            "prompt must be one prompt: this server does not batch several prompts in one request",
            "prompt",
        )
    else:
        raise InvalidRequest(
            "prompt is required: a non-empty string or a list of token ids", "prompt"
        )


def _messages(data: dict) -> list[dict[str, str]]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            "messages is required: a non-empty list of {role, content} objects", "messages"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise InvalidRequest(
                        "only text content parts are supported", f"messages[{i}].content"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a list of text parts",
                f"messages[{i}].content",
            )
        out.append({"role": message["role"], "content": content})
    return out


class StopStrings:
    """Ends the output at the first of `stops`: text is held back while it could still be
    the start of one, and what follows a match is dropped."""

    __slots__ = ("_hold", "_pending", "_stops", "matched")

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._hold = max(map(len, stops)) - 1
        self._pending = ""
        self.matched = False

    def feed(self, text: str, final: bool) -> str:
        """The text that may go out now; `matched` turns true at a stop string."""
        pending = self._pending + text
        cut = min((i for i in (pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.matched = True
            self._pending = ""
            return pending[:cut]
        if final:
            self._pending = ""
            return pending
        keep = 0
        for size in range(min(self._hold, len(pending)), 0, -1):
            tail = pending[-size:]
            if any(s.startswith(tail) for s in self._stops):
                keep = size
                break
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]


def _extension(chunk: Chunk, timing: ChunkTiming) -> bytes:
    """`cadence_timing`'s field of one event: the chunk's position, the positions it covers
    (`tokens`: an event can hold several tokens, or a model's text pieces, each one) and the
    server's timestamps."""
    return (
        b',"cadence":{"index":%d,"tokens":%d,"timing":'
        % (chunk.index, chunk.outputs or len(chunk.token_ids))
        + _encode(timing)
        + b"}"
    )


class Encoder:
    """The bytes of one request's responses: SSE events while streaming, or one body.

    An event is the request's fixed bytes around the chunk's own: everything that is the same
    for every event of the request (id, object, created, model, the choice's frame, `"usage":
    null` with `include_usage`) is encoded once, here; per event there is the text's JSON
    string, the finish reason and, with `cadence_timing`, the extension."""

    __slots__ = (
        "_chat",
        "_first",
        "_head",
        "_open",
        "_open_first",
        "_tail",
        "cached_tokens",
        "completion_tokens",
        "created",
        "id",
        "model",
        "prompt_tokens",
    )

    def __init__(self, endpoint: str, model: str, *, usage_null: bool = False) -> None:
        self._chat = endpoint == CHAT
        self.id = ("chatcmpl-" if self._chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())  # the wire's field: seconds since the epoch
        self.model = model
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = (
            b'data: {"id":"'
            + self.id.encode()
            + b'","object":"'
            + obj.encode()
            + b'","created":%d,"model":' % self.created
            + _encode(model)
        )
        if self._chat:
            self._open = self._head + b',"choices":[{"index":0,"delta":{"content":'
            self._open_first = (
                self._head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":'
            )
            close = b'},"logprobs":null,"finish_reason":'
        else:
            self._open = self._open_first = self._head + b',"choices":[{"index":0,"text":'
            close = b',"logprobs":null,"finish_reason":'
        usage = b',"usage":null' if usage_null else b""
        self._tail = {
            finish: close + _encode(finish) + b"}]" + usage
            for finish in (None, *FINISH_REASON.values())
        }
        """What follows the text, by finish reason: the choice's end, then `usage`."""
        self._first = True
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0

    def event(self, text: str, finish: str | None, chunk: Chunk | None = None) -> bytes:
        """One SSE event of a streamed response (with `usage_null`, as `include_usage` asks,
        every event but the usage one carries `"usage":null`; a `chunk` with timing adds
        `cadence`). The first event of a chat opens its message with the role."""
        tail = self._tail[finish]
        if self._first:
            self._first = False
            start = self._open_first
        else:
            start = self._open
        if self._chat and finish is not None and not text:
            # The closing event of a chat: an empty delta.
            start, text_json = self._head + b',"choices":[{"index":0,"delta":{', b""
        else:
            text_json = _encode(text)
        if chunk is not None and chunk.timing is not None:
            return b"".join((start, text_json, tail, _extension(chunk, chunk.timing), b"}\n\n"))
        return b"".join((start, text_json, tail, b"}\n\n"))

    def usage(self) -> dict[str, object]:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens` as OpenAI and vLLM give it
        (the prompt tokens the prefix cache served), when the server caches prefixes."""
        usage: dict[str, object] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def usage_event(self) -> bytes:
        """The last chunk with `stream_options.include_usage`: no choices, the usage."""
        return self._head + b',"choices":[],"usage":' + _encode(self.usage()) + b"}\n\n"

    def count(self, chunk: Chunk) -> None:
        if chunk.index == 0:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.cached_tokens:
            self.cached_tokens = chunk.cached_tokens
        self.completion_tokens += chunk.outputs or len(chunk.token_ids)

    def whole(self, text: str, finish: str | None) -> bytes:
        """The body of a response with `stream: false`."""
        if self._chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return _encode(
            {
                "id": self.id,
                "object": "chat.completion" if self._chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": self.usage(),
            }
        )


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> bytes:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return _encode({"error": {"message": message, "type": kind, "param": param, "code": code}})


def failure_body(failure: Failure, message: str, param: str | None = None) -> tuple[int, bytes]:
    """The HTTP status (cadence.api.errors, the one map) and the error body of a failure;
    `code` is the failure's name in lower case."""
    status, kind = http_status(failure)
    return status, error_body(message, kind, failure.name.lower(), param)


_CORE_FIELDS = {
    "prompt_token_ids": "prompt",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
    "sampling.stop_token_ids": "stop_token_ids",
}
"""The body's field of each of the core's names (`RequestError.parameter`, its `Request`'s
fields) that the OpenAI wire names otherwise; the rest (`max_tokens`, `prompt`, `priority`)
are the same, and `parse`'s own are the body's already."""


def error_response(exc: RequestError, endpoint: str) -> tuple[int, bytes]:
    """The HTTP status and error body of a request's failure, whoever raised it (`parse`,
    the core, a worker): the one map from cadence's errors to the OpenAI wire. The body's
    `param` is the field the failure is about, as the body names it (a chat's prompt is its
    `messages`); null when it is about no one field."""
    param = exc.parameter
    if param is not None:
        param = _CORE_FIELDS.get(param, param)
        if param == "prompt" and endpoint == CHAT:
            param = "messages"
    return failure_body(exc.failure, exc.message, param)


def models_body(model: str, created: int) -> bytes:
    return _encode(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": "cadence"}],
        }
    )
