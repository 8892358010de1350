"""The words every stage of a token's path shares, below all of them and of no protocol: what
a worker is asked to generate (`AddRequest`, as the front sends it and an engine reads it, with
its `Sampling` carried whole from the protocol adapter that read it to the engine), and how a
request ends (`Finish` when it completed, `Failure` when it did not). The front's
core speaks them, every protocol adapter maps them to its wire (cadence.api.errors), the
transport carries them between processes (cadence.transport.messages), workers and engines
read and report them."""

from __future__ import annotations

import enum

import msgspec


class Sampling(
    msgspec.Struct,
    frozen=True,
    omit_defaults=True,
    rename={"temperature": "t", "top_p": "p", "top_k": "k", "seed": "s", "stop_token_ids": "x"},
):
    """A request's generation parameters: how each next token is chosen and which tokens end
    the output. One value from the protocol adapter that read them (cadence.core.requests'
    `Request`) through the worker's message (`AddRequest`) to the engine's `Sequence` and an
    app's `AppRequest`; every stage reads the fields here, none restates them.

    Encoded as a map without its default fields, under one-letter keys: a greedy request's
    costs its worker message one byte."""

    temperature: float = 0.0
    """0: greedy."""
    top_p: float = 0.0
    """Nucleus sampling's mass; 0 or 1: off."""
    top_k: int = 0
    """0: off."""
    seed: int = 0
    """The request's seed; an engine mixes in its own (`--seed`)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (finish STOP); the stop token itself is sent."""


GREEDY = Sampling()
"""The default: greedy, no stop tokens."""


class AddRequest(msgspec.Struct, frozen=True, array_like=True):
    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: Sampling = GREEDY
    timeout_ms: float = 0.0
    """Time left until the request's deadline when the front sent it; 0: no deadline.
    Relative, so it stays right when a worker's clock is not the front's."""
    prompt_text: str = ""
    """A text prompt for the worker to tokenize with the model's tokenizer (torch engine);
    then `prompt_token_ids` is empty. The app engine gets it beside the prompt's UTF-8 bytes,
    for a function with its own tokenizer."""
    priority: int = 0
    """Lower is admitted and stepped first (vLLM's sense); FCFS within one priority."""


class Finish(enum.IntEnum):
    """Why a sequence ended; the values are those of the proto's FinishReason."""

    NONE = 0
    LENGTH = 1
    STOP = 2
    CANCELLED = 3


class Failure(enum.IntEnum):
    """Why a request ended without finishing: the one error vocabulary of cadence, from the
    worker that detects a failure to the front that reports it. The names (and numbers) are
    gRPC's status codes; cadence.api.errors maps each to every protocol's own form."""

    CANCELLED = 1
    """The client went away (or a drain ended the request)."""
    INVALID_ARGUMENT = 3
    """The request cannot be served as sent; the message says what to change."""
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    """The request names a model (or version) this server does not serve."""
    RESOURCE_EXHAUSTED = 8
    """A limit: --max-concurrent, --overflow abort, --stall-timeout, message size."""
    INTERNAL = 13
    """The app's function raised, or yielded something that is not output."""
    UNAVAILABLE = 14
    """Not now, retry: starting, draining, its worker stopped, no worker."""


def prompt_over_limit(length: int, most: int) -> str | None:
    """Why a prompt of `length` tokens is refused where --max-prompt-tokens is `most`, in the
    same words whichever stage counted it (the front, or a worker that tokenizes text with
    the model's own tokenizer); None within the limit."""
    if length <= most:
        return None
    return (
        f"the prompt has {length} tokens; this server allows at most {most} (--max-prompt-tokens)"
    )
