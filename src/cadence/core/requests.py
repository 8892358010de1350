"""The core's own request and chunk types: what every protocol adapter maps its wire to and
from, and all the core knows of a request.

A `Request` is what a client asked for, not yet checked (`FrontCore.open` validates it); a
`Chunk` is one message of its output stream, whatever the protocol makes of it.
"""

from __future__ import annotations

import msgspec

from cadence.vocabulary import GREEDY, Sampling

SEED_RANGE = (-(2**63), 2**64 - 1)
"""A seed is any 64-bit integer, signed or not (OpenAI's clients send int64, cadence.v1 uint64);
a wider one cannot cross to a worker."""
TOKEN_ID_MAX = 2**31 - 1
"""Token ids are int32, as in cadence.v1's proto and the KServe model's tensors."""
TOP_K_MAX = 2**32 - 1
"""cadence.v1's uint32."""
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
"""cadence.v1's int32."""
REQUEST_ID_MAX_BYTES = 256
"""The longest client-given request id (UTF-8 bytes): cadence.v1 echoes it on every chunk and
KServe on every response, so an unbounded one multiplies the output (a 3 MB id, a 1.5 GB
stream). Ids are UUIDs (36) or a caller's own keys; 256 is room for any of them."""


class Request(msgspec.Struct, kw_only=True):
    """One generation request, as an adapter read it from its wire."""

    request_id: str = ""
    """The client's id; empty: the server assigns one."""
    prompt: str = ""
    """Text; used when `prompt_token_ids` is empty."""
    prompt_token_ids: list[int] = []
    max_tokens: int = 0
    sampling: Sampling = GREEDY
    """Temperature, top-p, top-k, seed and stop token ids, as one value: the worker's message
    and the engine carry it as it is."""
    priority: int = 0
    """Scheduling priority, as vLLM's: lower is served first; FCFS within one."""
    include_timing: bool = False
    """Put the server's timestamps of each hop on every chunk (`Chunk.timing`)."""
    traceparent: str = ""
    """The caller's W3C trace context (read by the adapter only while tracing is on)."""
    tracestate: str = ""


class ChunkTiming(msgspec.Struct, kw_only=True, gc=False):
    """Server timestamps of one chunk (time.monotonic_ns(), on the front's clock)."""

    worker: int
    received_ns: int = 0
    """The request reached the front (first chunk only)."""
    scheduled_ns: int = 0
    """The step that admitted the request began (first chunk only)."""
    step_start_ns: int = 0
    """The step of the chunk's first (oldest) token began..."""
    step_end_ns: int = 0
    """...and ended."""
    front_recv_ns: int = 0
    """The front read that step's message."""
    send_ns: int = 0
    """The chunk was handed to the protocol adapter."""
    step_cpu_wait_ns: int = -1
    """How long the engine's threads waited for a CPU from the worker's step before the
    chunk's first token's step to that step's end (`StepOutput.cpu_wait_ns`; -1: not
    measured)."""
    prefill_worker: int = -1
    """Disaggregated serving: the worker that prefilled the request, once it was handed off
    to `worker` (-1: not handed off)."""
    handoff_ns: int = 0
    """When the front got the request's state from its prefill worker (0: not handed off)."""


class Chunk(msgspec.Struct, array_like=True, gc=False):
    """One message of a request's output: every token that was waiting when it was taken."""

    index: int
    """Position of the first output in the stream: outputs are tokens, or a batched model's
    text pieces (each one output whatever its token ids; positions count what max_tokens
    counts)."""
    token_ids: list[int]
    text: str
    """The tokens' text (a character split across chunks comes whole in the later one)."""
    finish: int
    """A Finish value; not NONE on the last chunk only."""
    prompt_tokens: int = 0
    """Tokens of the prompt, on the first chunk (index 0)."""
    timing: ChunkTiming | None = None
    """With `Request.include_timing`."""
    cached_tokens: int = 0
    """Prompt tokens the worker's prefix cache served (known from the first chunk on; the
    protocols put it on the last)."""
    outputs: int = 0
    """Positions the chunk covers when not one per token id (a model's text pieces); 0: as
    many as `token_ids`. `positions` reads both."""

    @property
    def positions(self) -> int:
        """Positions the chunk covers: the next chunk's index is `index + positions`."""
        return self.outputs or len(self.token_ids)
