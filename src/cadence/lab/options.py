"""The options of `cadence bench`, `sweep` and `capacity`, each stated here once, on its field,
as `cadence serve`'s are in cadence.config: its type, default, choices (a `Literal`) and, as a
`Flag`, its help, its section of the help and the commands that take it. The three commands'
flags and their help's sections are generated from these declarations (`add_flags`); the
sweep's load variables are the declared options marked `vary` (`client_variables`); and each
option says which entries of the result's workload record carry it (`Flag.record`), those that
hold it alone read from the run's load as it says (`recorded`).

The flags are contracts (tests/unit/lab/test_lab_flags.py holds each one's destination, default,
choices and the rest): a declaration may change how a flag is written down, never what it is.
"""

# No `from __future__ import annotations`: the declarations are evaluated where they are
# written, so that a `Flag.vary` lambda in one sees this module's functions (typing's
# get_type_hints would evaluate a string annotation with the class's namespace as globals).

import argparse
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import msgspec

BENCH, SWEEP, CAPACITY = "bench", "sweep", "capacity"
LAB = (BENCH, SWEEP, CAPACITY)

# The sections of the help (argparse's argument groups). Their first word is their name for
# `--help=SECTION` (cadence.cli).
GENERAL = ""
"""The section of the help that lists the options with no section of their own."""
SERVERS = "servers (those the sweep starts, one per run)"
PROTOCOL = "protocol (how the load talks to the server)"
GRPC = "grpc: --protocol grpc (any server-streaming or bidirectional method)"
LOAD = "load (how the requests arrive, and how many)"
REQUESTS = "requests (their lengths, prompts and classes)"
REPLAY = "replay (of a --trace)"
SESSIONS = "sessions (--sessions: conversations of several turns)"
CLIENTS = "clients (the load's processes, and how each request behaves)"
MEASURE = "measurement (what else the run reads, and how it is judged)"

ARRIVALS = "arrivals"
"""The mutually exclusive ways the requests arrive: closed loop, a rate, stages, a trace,
sessions."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """A field as a flag of the lab's commands, declared on it (`Annotated[type, Flag(...)]`),
    so the field's name, type, default and choices are the flag's destination, type, default
    and choices."""

    help: str | Mapping[str, str]
    """The flag's help; a mapping gives each command its own (by command name), where one
    text cannot fit all. argparse adds "(default: ...)" unless the help speaks of it."""
    section: str = GENERAL
    commands: tuple[str, ...] = LAB
    """The commands that take the flag."""
    required: tuple[str, ...] = ()
    """The commands where it must be given (it then has no default)."""
    flag: str = ""
    """The flag, when it is not the field's name with dashes."""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    """The flag's text to its value (raises argparse.ArgumentTypeError); default: the
    field's type (a list's: its element's, the flag then repeatable)."""
    const: Any = None
    """Set: the flag's value may be left out (`--flag` alone), and is then this."""
    exclusive: str = ""
    """The flags of one name here exclude each other."""
    vary: Callable[[Any, str], Any] | None = None
    """Set: `cadence sweep --vary NAME=V1,...` varies this load option: how one value changes
    a run's load (a `cadence.lab.sweep.Load`); raises ValueError when the value does not fit
    (cadence.lab.sweep.CLIENT_VARIABLES)."""
    record: Mapping[str, Callable[[Any], Any] | None] | None = None
    """Where the result's workload record (cadence.lab.results.Workload) carries the option:
    its JSON keys, each with how its value is read from the run's load (a
    `cadence.lab.bench.Workload`), or DERIVED; NOT_RECORDED: nowhere. Every option says
    (tests/unit/lab/test_workload_record.py holds it), so none is left out unseen."""


DERIVED = None
"""A workload record's entry that the bench builds of more than one option's value, or of
what it is given beside the load (cadence.lab.bench._workload_record, the protocol's
`describe`)."""
NOT_RECORDED: Mapping[str, Callable[[Any], Any] | None] = types.MappingProxyType({})
"""The option is in no entry of the workload record."""


@dataclasses.dataclass(frozen=True)
class LabOption:
    """One option of the lab's commands, as its field declares it."""

    name: str
    """The field's name: where the flag's value goes (`args.NAME`)."""
    kind: Any
    default: Any
    declared: Flag

    @property
    def flag(self) -> str:
        return self.declared.flag or "--" + self.name.replace("_", "-")

    def argument(self, command: str) -> dict:
        """argparse's arguments for this option's flag in `command`."""
        declared = self.declared
        help_ = declared.help if isinstance(declared.help, str) else declared.help[command]
        argument: dict[str, Any] = {"dest": self.name, "help": help_.replace("%", "%%")}
        if command in declared.required:
            argument["required"] = True
        else:
            argument["default"] = self.default
        if self.kind is bool:
            return {**argument, "action": "store_true"}
        kind = self.kind
        if typing.get_origin(kind) is list:
            argument["action"] = "append"
            kind = typing.get_args(kind)[0]
        if declared.const is not None:
            argument.update(nargs="?", const=declared.const)
        if typing.get_origin(kind) is Literal:
            argument["choices"] = typing.get_args(kind)
        else:
            kinds = [k for k in typing.get_args(kind) if k is not type(None)]
            argument["type"] = declared.parse or (kinds[0] if kinds else kind)
        if declared.metavar is not None:
            argument["metavar"] = declared.metavar
        return argument


# --- the flags' texts to values (argparse types) ---


def length(text: str):
    """`--max-tokens`/`--prompt-tokens` (`cadence.lab.load.lengths.token_lengths`)."""
    from cadence.lab.load.lengths import token_lengths

    try:
        return token_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    """A number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {text!r}")
    return value


def _speed(text: str) -> float:
    value = _seconds(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a speed above 0, got {text!r}")
    return value


def _window(text: str) -> tuple[float, float | None]:
    """`START:END` seconds into a trace; either may be left out."""
    start, sep, end = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected START:END (seconds), got {text!r}")
    try:
        bounds = (float(start or 0), float(end) if end else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END (seconds), got {text!r}") from None
    if bounds[0] < 0 or (bounds[1] is not None and bounds[1] <= bounds[0]):
        raise argparse.ArgumentTypeError(f"expected 0 <= START < END, got {text!r}")
    return bounds


_CLASS_KEYS = ("prompt", "max", "slo")


def _request_class(text: str) -> tuple[str, str | None, str | None, list[str]]:
    """`NAME prompt=LEN max=LEN slo=TERM,...`: (name, prompt, max, SLO terms), the lengths as
    given (None: the run's)."""
    from cadence.lab.analysis.goodput import parse_term

    name, *fields = text.split()
    given: dict[str, str] = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if not sep or key not in _CLASS_KEYS or not value:
            raise argparse.ArgumentTypeError(
                f"expected 'NAME prompt=LEN max=LEN slo=TERM,...', got {item!r} in {text!r}"
            )
        given[key] = value
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"a class name is one word, got {name!r}")
    slo = given.get("slo", "").split(",") if "slo" in given else []
    try:
        for term in slo:
            parse_term(term)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--class {name}: {exc}") from None
    return name, given.get("prompt"), given.get("max"), slo


def _mix_shares(text: str) -> list[tuple[str, float]]:
    """`NAME:SHARE%,...`: (name, share in 0..1) pairs that add up to 1."""
    shares = []
    for part in text.split(","):
        name, sep, share = part.strip().partition(":")
        try:
            value = float(share.removesuffix("%")) / 100 if sep else math.nan
        except ValueError:
            value = math.nan
        if not name or not value > 0:
            raise argparse.ArgumentTypeError(
                f"expected NAME:SHARE%,... (e.g. chat:70%,summarize:30%), got {part!r}"
            )
        shares.append((name, value))
    if abs(sum(v for _, v in shares) - 1.0) > 1e-6:
        raise argparse.ArgumentTypeError(
            f"the shares of --mix add up to {sum(v for _, v in shares):.0%}, not 100%"
        )
    return shares


def _share_of(text: str) -> tuple[float, float]:
    """`MS` (every request) or `MS@SHARE%`: (ms, share in 0..1)."""
    value, sep, share = text.partition("@")
    try:
        ms = float(value)
        part = float(share.removesuffix("%")) / 100 if sep else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MS or MS@SHARE%, got {text!r}") from None
    if ms < 0 or not 0 < part <= 1:
        raise argparse.ArgumentTypeError(f"expected MS >= 0 and 0 < SHARE <= 100%, got {text!r}")
    return ms, part


def _rate(text: str) -> float | tuple[float, float]:
    """`R` or `LO:HI` requests/s."""
    lo, sep, hi = text.partition(":")
    try:
        rates: tuple[float, ...] = (float(lo), float(hi)) if sep else (float(lo),)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R or LO:HI requests/s, got {text!r}") from None
    if not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected rates above 0, got {text!r}")
    return (rates[0], rates[1]) if sep else rates[0]


def _duration(text: str) -> float:
    """Seconds, with or without an `s`."""
    return _seconds(text.removesuffix("s"))


def _stages(text: str) -> list[tuple[float, float, float]]:
    """`R:S,R:S,...`: steps of R requests/s for S seconds."""
    stages = []
    for part in text.split(","):
        rate, sep, length = part.strip().partition(":")
        try:
            r, s = float(rate), _duration(length)
        except (ValueError, argparse.ArgumentTypeError):
            r = s = 0.0
        if not sep or r <= 0 or s <= 0:
            raise argparse.ArgumentTypeError(
                f"expected RATE:SECONDS,... (e.g. 10:30,50:30), got {part!r}"
            )
        stages.append((r, r, s))
    return stages


# --- how a swept value changes a run's load (cadence.lab.sweep.Load; ValueError) ---


def _whole(text: str, least: int = 1) -> int:
    try:
        number = int(text)
    except ValueError:
        number = least - 1
    if number < least:
        raise ValueError(f"expected a whole number of at least {least}, got {text!r}")
    return number


def _number(text: str) -> float:
    try:
        number = float(text)
    except ValueError:
        number = -1.0
    if not number >= 0:  # NaN too
        raise ValueError(f"expected a number of at least 0, got {text!r}")
    return number


def _workload(load, **changes):
    return dataclasses.replace(load, workload=dataclasses.replace(load.workload, **changes))


def _shape(load, **changes):
    return _workload(load, shape=msgspec.structs.replace(load.workload.shape, **changes))


def _lengths(text: str) -> tuple[int, int]:
    from cadence.lab.load.lengths import token_lengths

    return token_lengths(text)  # type: ignore[return-value]  # a distribution as the flag's


# --- the options' declarations, read ---


@functools.cache
def declared(cls: type) -> tuple[LabOption, ...]:
    """The options that `cls`'s fields declare, in their order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    options = []
    for field in msgspec.structs.fields(cls):
        flag = next(m for m in hints[field.name].__metadata__ if isinstance(m, Flag))
        default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
        options.append(LabOption(field.name, typing.get_args(hints[field.name])[0], default, flag))
    return tuple(options)


def recorded(load: Any) -> dict[str, Any]:
    """The workload record's entries that each hold one option, as the options declare them
    (`Flag.record`), read from the run's load (a `cadence.lab.bench.Workload`)."""
    return {
        key: value(load)
        for cls in DECLARING
        for option in declared(cls)
        for key, value in (option.declared.record or {}).items()
        if value is not DERIVED
    }


def _said(lengths: Any) -> Any:
    """A length option's distribution as the workload record says it; unset for N or LO:HI."""
    return msgspec.UNSET if lengths is None else lengths.said


def client_variables() -> dict[str, Callable[[Any, str], Any]]:
    """The load options the sweep can vary (`Flag.vary`), each with how one value changes a
    run's load."""
    return {
        o.name: o.declared.vary for o in declared(WorkloadOptions) if o.declared.vary is not None
    }


# --- the declarations ---

SERVE_ARGS = "--devices cpu:2 --step-ms 20"
"""`cadence sweep`'s servers when `--serve-args` does not say."""


class ProtocolOptions(msgspec.Struct, kw_only=True):
    """How the load talks to the server."""

    protocol: Annotated[
        Literal["cadence", "kserve", "grpc", "openai"],
        Flag(
            "cadence.v1.Inference/Generate (default), the Open Inference Protocol (KServe v2 / "
            "Triton gRPC, ModelStreamInfer) of any server that speaks it, any gRPC streaming "
            "method (--method, --request-json), or the OpenAI HTTP API with SSE of any server "
            "that speaks it (docs/openai.md)",
            PROTOCOL,
            record={"protocol": DERIVED},
        ),
    ] = "cadence"
    model: Annotated[
        str,
        Flag(
            "--protocol kserve or openai: the model to drive (default: cadence's own)",
            PROTOCOL,
            record={"model": DERIVED},
        ),
    ] = "cadence"
    endpoint: Annotated[
        Literal["completions", "chat"],
        Flag(
            "--protocol openai: /v1/completions (default) or /v1/chat/completions",
            PROTOCOL,
            record={"openai": DERIVED},
        ),
    ] = "completions"
    tokenizer: Annotated[
        str | None,
        Flag(
            "--protocol openai: a Hugging Face tokenizer folder (its tokenizer.json, on this "
            "host): another server's output is counted in its tokens rather than by events or the "
            "server's usage",
            PROTOCOL,
            metavar="PATH",
            record=NOT_RECORDED,
        ),
    ] = None
    kserve_inputs: Annotated[
        str,
        Flag(
            "--protocol kserve: the model's INT32 inputs; SOURCE is prompt (the prompt's token "
            "ids), max_tokens, or an integer (e.g. 'N=max_tokens,DELAY_MS=10' for the PyTriton "
            "peer), each optionally followed by :batched (a leading batch dimension of one, for "
            "a Triton model with batching)",
            PROTOCOL,
            metavar="NAME=SOURCE,...",
            record=NOT_RECORDED,
        ),
    ] = "PROMPT_TOKEN_IDS=prompt,MAX_TOKENS=max_tokens"
    method: Annotated[
        str | None,
        Flag(
            "the method to drive", GRPC, metavar="PACKAGE.SERVICE/METHOD", record={"grpc": DERIVED}
        ),
    ] = None
    request_json: Annotated[
        str | None,
        Flag(
            'the request in the proto3 JSON mapping; whole string values "{max_tokens}", '
            '"{prompt}", "{request_id}" and "{i}" are replaced per request',
            GRPC,
            metavar="JSON",
            record={"grpc": DERIVED},
        ),
    ] = None
    proto: Annotated[
        list[str],
        Flag(
            "the service's .proto file (repeatable), when the server offers no reflection",
            GRPC,
            metavar="FILE",
            record={"grpc": DERIVED},
        ),
    ] = []
    proto_path: Annotated[
        list[str],
        Flag(
            "where --proto files and their imports are found (repeatable)",
            GRPC,
            metavar="DIR",
            record=NOT_RECORDED,
        ),
    ] = []
    tokens_field: Annotated[
        str,
        Flag(
            "the response field that holds its tokens (a repeated field counts its elements, a "
            "number is a count, a string is one); default: one message is one token",
            GRPC,
            metavar="NAME",
            record={"grpc": DERIVED},
        ),
    ] = ""
    index_field: Annotated[
        str,
        Flag(
            "the response field that numbers the output (the position of the message's first "
            "token, or the message's number without --tokens-field): turns on the "
            "lost/repeated/reordered checks",
            GRPC,
            metavar="NAME",
            record={"grpc": DERIVED},
        ),
    ] = ""
    header: Annotated[
        list[str],
        Flag(
            "metadata sent with every call (repeatable), e.g. authorization=...",
            GRPC,
            metavar="KEY=VALUE",
            record={"grpc": DERIVED},
        ),
    ] = []


GRPC_ONLY = tuple(o.name for o in declared(ProtocolOptions) if o.declared.section == GRPC)
"""The options that only `--protocol grpc` takes."""


class WorkloadOptions(msgspec.Struct, kw_only=True):
    """What load to send: how many requests, how they arrive, what they look like, and how
    the clients behave (cadence.lab.bench_cli.workload_from_args makes the bench's Workload of
    them)."""

    concurrency: Annotated[
        int,
        Flag(
            "streams open at once (closed loop)",
            LOAD,
            exclusive=ARRIVALS,
            vary=lambda load, v: _workload(load, concurrency=_whole(v), rate=None),
            record={
                "concurrency": lambda load: (
                    None if load.rate or load.shape.trace else load.concurrency
                )
            },
        ),
    ] = 64
    rate: Annotated[
        float | tuple[float, float] | None,
        Flag(
            "requests/s, Poisson arrivals (open loop); LO:HI with --ramp: rising from LO to HI",
            LOAD,
            parse=_rate,
            metavar="R|LO:HI",
            exclusive=ARRIVALS,
            vary=lambda load, v: _workload(load, rate=_number(v)),
            record={"rate": lambda load: load.rate},
        ),
    ] = None
    stages: Annotated[
        list[tuple[float, float, float]] | None,
        Flag(
            "open loop in steps: R requests/s for S seconds, then the next; the run ends with "
            "the last",
            LOAD,
            parse=_stages,
            metavar="R:S,R:S,...",
            exclusive=ARRIVALS,
            record={"rate_stages": DERIVED},
        ),
    ] = None
    trace: Annotated[
        str | None,
        Flag(
            "replay a trace (open loop, each request at its time): JSONL or CSV rows of timestamp "
            "(ms), input_length, output_length and optionally hash_ids (Mooncake: prompts that "
            "share blocks share prefixes) and session_id",
            LOAD,
            metavar="FILE",
            exclusive=ARRIVALS,
            record={"trace": DERIVED},
        ),
    ] = None
    sessions: Annotated[
        int | None,
        Flag(
            "N conversations at once, each --turns turns: every turn sends the history and a new "
            "user message (--prompt-tokens long; the answers in the history are stand-ins "
            "--max-tokens long)",
            LOAD,
            parse=_positive,
            metavar="N",
            exclusive=ARRIVALS,
            record={"conversation": DERIVED},
        ),
    ] = None
    requests: Annotated[
        int | None,
        Flag(
            "requests in all (default: --concurrency, unless --duration is given)",
            LOAD,
            vary=lambda load, v: _workload(load, requests=_whole(v)),
            record={"requests": lambda load: load.requests},
        ),
    ] = None
    duration: Annotated[
        float | None,
        Flag(
            "stop sending new requests after S seconds",
            LOAD,
            vary=lambda load, v: _workload(load, duration_s=_number(v)),
            record={"duration_s": lambda load: load.duration_s},
        ),
    ] = None
    max_tokens: Annotated[
        str,
        Flag(
            "N, LO:HI (uniform), normal:MEAN,SD, lognormal:MEAN,SD (either with ,MIN,MAX) or "
            "empirical:FILE (one length a line)",
            REQUESTS,
            parse=length,
            vary=lambda load, v: _shape(load, max_tokens=_lengths(v), output_lengths=None),
            record={
                "max_tokens": lambda load: list(load.shape.max_tokens),
                "output_length_distribution": lambda load: _said(load.shape.output_lengths),
            },
        ),
    ] = "128"
    prompt_tokens: Annotated[
        str,
        Flag(
            "as --max-tokens, for the prompt",
            REQUESTS,
            parse=length,
            vary=lambda load, v: _shape(load, prompt_tokens=_lengths(v), prompt_lengths=None),
            record={
                "prompt_tokens": lambda load: list(load.shape.prompt_tokens),
                "prompt_length_distribution": lambda load: _said(load.shape.prompt_lengths),
            },
        ),
    ] = "16"
    prompts: Annotated[
        str | None,
        Flag(
            'JSONL file of {"prompt": ..., "max_tokens": ...}',
            REQUESTS,
            record={"prompts_from_file": lambda load: len(load.shape.prompts)},
        ),
    ] = None
    classes: Annotated[
        list[str],
        Flag(
            "a request class for --mix (repeatable): its name, then its prompt and output lengths "
            "(as --prompt-tokens and --max-tokens; default theirs) and optionally its own SLO "
            "terms (as --slo), separated by spaces, e.g. --class 'chat prompt=128 max=64 "
            "slo=ttft_p99_ms=200'",
            REQUESTS,
            flag="--class",
            parse=_request_class,
            metavar="'NAME prompt=LEN max=LEN slo=TERM,...'",
            record={"mix": DERIVED},
        ),
    ] = []
    mix: Annotated[
        list[tuple[str, float]] | None,
        Flag(
            "send the --class classes in these shares (e.g. 'chat:70%,summarize:30%'; they add up "
            "to 100%): results by class",
            REQUESTS,
            parse=_mix_shares,
            metavar="NAME:SHARE%,...",
            record={"mix": DERIVED},
        ),
    ] = None
    ramp: Annotated[
        float | None,
        Flag(
            "with --rate LO:HI: the rate rises linearly from LO to HI over S seconds (e.g. 120s), "
            "then holds",
            LOAD,
            parse=_duration,
            metavar="S",
            record={"rate_stages": DERIVED},
        ),
    ] = None
    saturation_stop: Annotated[
        float | None,
        Flag(
            "with --rate LO:HI --ramp S or --stages: end the run once the server no longer keeps "
            "up (in windows of WINDOW_S seconds, default 2: the achieved rate more than 10% under "
            "the offered one while TTFT p50 grows past twice its floor, two windows in a row) and "
            "report the knee's rate (JSON `saturation`)",
            LOAD,
            parse=_duration,
            const=2.0,
            metavar="WINDOW_S",
            record=NOT_RECORDED,
        ),
    ] = None
    warmup_duration: Annotated[
        float,
        Flag(
            "the requests sent in the run's first S seconds are sent but not counted",
            LOAD,
            parse=_duration,
            metavar="S",
            record={"warmup_s": lambda load: load.warmup_s or msgspec.UNSET},
        ),
    ] = 0.0
    trace_speed: Annotated[
        float,
        Flag(
            "--trace: play it X times as fast (0.5: half as fast)",
            REPLAY,
            parse=_speed,
            metavar="X",
            record={"trace": DERIVED},
        ),
    ] = 1.0
    trace_window: Annotated[
        tuple[float, float | None] | None,
        Flag(
            "--trace: only the rows from START to END seconds after its first (either may be left "
            "out), the replay starting at START",
            REPLAY,
            parse=_window,
            metavar="START:END",
            record={"trace": DERIVED},
        ),
    ] = None
    trace_block_tokens: Annotated[
        int,
        Flag(
            "--trace: tokens per hash_ids block (Mooncake's: 512)",
            REPLAY,
            parse=_positive,
            metavar="N",
            record={"trace": DERIVED},
        ),
    ] = 512
    turns: Annotated[
        int | None,
        Flag(
            "--sessions: turns per conversation (default 3)",
            SESSIONS,
            parse=_positive,
            metavar="K",
            record={"conversation": DERIVED},
        ),
    ] = None
    think_ms: Annotated[
        float,
        Flag(
            "--sessions: pause between a turn's end and the next turn",
            SESSIONS,
            parse=_seconds,
            metavar="D",
            record={"conversation": DERIVED},
        ),
    ] = 0.0
    session_header: Annotated[
        str,
        Flag(
            "send each request's session id in this header (gRPC metadata, HTTP header), for a "
            "server or proxy that routes a session to one replica (--sessions, or a --trace with "
            "session_id)",
            SESSIONS,
            metavar="NAME",
            record={"conversation": DERIVED},
        ),
    ] = ""
    seed: Annotated[
        int,
        Flag(
            "seed of the requests' lengths and prompts",
            REQUESTS,
            record={"seed": lambda load: load.shape.seed},
        ),
    ] = 0
    warmup: Annotated[
        int,
        Flag(
            "requests per process sent first, not counted",
            CLIENTS,
            vary=lambda load, v: _workload(load, warmup=_whole(v, least=0)),
            record=NOT_RECORDED,
        ),
    ] = 0
    timeout: Annotated[
        float | None,
        Flag(
            "per-request deadline (s)",
            CLIENTS,
            vary=lambda load, v: _workload(load, timeout_s=_number(v)),
            record=NOT_RECORDED,
        ),
    ] = None
    stall_limit: Annotated[
        float | None,
        Flag(
            "end a request that gets no message for S seconds (its first counted from its start) "
            "as failed, code STALLED (default: 60 without --timeout, none with it; 0: none)",
            CLIENTS,
            parse=_seconds,
            metavar="S",
            record=NOT_RECORDED,
        ),
    ] = None
    procs: Annotated[
        int,
        Flag(
            "load-generating processes",
            CLIENTS,
            vary=lambda load, v: dataclasses.replace(load, processes=_whole(v)),
            record={"client_processes": DERIVED},
        ),
    ] = 1
    channels: Annotated[
        int,
        Flag(
            "gRPC connections per process",
            CLIENTS,
            vary=lambda load, v: dataclasses.replace(load, channels=_whole(v)),
            record={"channels_per_process": DERIVED},
        ),
    ] = 1
    read_delay_ms: Annotated[
        tuple[float, float],
        Flag(
            "pause after each chunk, to play a slow-reading client; with @SHARE% only that share "
            "of the requests (the slow_reader population)",
            CLIENTS,
            parse=_share_of,
            metavar="MS[@SHARE%]",
            vary=lambda load, v: _workload(load, read_delay_ms=_number(v)),
            record={"read_delay_ms": lambda load: load.read_delay_ms},
        ),
    ] = (0.0, 1.0)
    cancel_ms: Annotated[
        tuple[float, float] | None,
        Flag(
            "cancel that share of the requests MS after their send, mid-stream (the cancelling "
            "population; counted apart from errors)",
            CLIENTS,
            parse=_share_of,
            metavar="MS@SHARE%",
            record=NOT_RECORDED,
        ),
    ] = None
    deadline_ms: Annotated[
        tuple[float, float] | None,
        Flag(
            "give that share of the requests a deadline of MS (the deadline population)",
            CLIENTS,
            parse=_share_of,
            metavar="MS@SHARE%",
            record=NOT_RECORDED,
        ),
    ] = None
    no_timing: Annotated[
        bool, Flag("do not ask for server timestamps", CLIENTS, record=NOT_RECORDED)
    ] = False


class MeasureOptions(msgspec.Struct, kw_only=True):
    """What the run reads besides its requests, and what it is judged by."""

    server_pid: Annotated[
        int | None,
        Flag(
            "the server process whose CPU to sample (default: cadence's processes, or the process "
            "listening on a local target's port)",
            MEASURE,
            commands=(BENCH,),
            metavar="PID",
            record=NOT_RECORDED,
        ),
    ] = None
    baseline: Annotated[
        bool,
        Flag(
            "also run the workload through the engine alone (local server only) and report "
            "serving overhead",
            MEASURE,
            commands=(BENCH,),
            record=NOT_RECORDED,
        ),
    ] = False
    slo: Annotated[
        list[str],
        Flag(
            {
                BENCH: "a latency SLO term, repeatable (e.g. --slo ttft_p99_ms=150 --slo "
                "itl_p99_ms=40; METRIC ttft, itl, tpot, e2e or token_delay, STAT p50, p90, p99 "
                "or max): goodput counts the requests that meet every term, and the run passes "
                "when its percentiles do (default: none)",
                CAPACITY: "a latency SLO term, repeatable (e.g. --slo ttft_p99_ms=150 --slo "
                "itl_p99_ms=40; METRIC ttft, itl, tpot, e2e or token_delay, STAT p50, p90, "
                "p99 or max); a load passes when its run's percentiles meet every term and "
                "no request failed",
            },
            MEASURE,
            commands=(BENCH, CAPACITY),
            required=(CAPACITY,),
            metavar="METRIC_STAT_ms=BOUND",
            record=NOT_RECORDED,
        ),
    ] = []
    scrape: Annotated[
        list[str],
        Flag(
            "a Prometheus metrics page of any server (e.g. vLLM's http://HOST:8000/metrics), "
            "repeatable: read every 0.5 s during the run, its gauges and counters' rates kept on "
            "the run's time axis (JSON `scraped`), and the requests running, waiting and the KV "
            "cache in use of vLLM, SGLang, Triton and cadence given to the diagnosis; checked "
            "before the run (default: none)",
            MEASURE,
            metavar="URL",
            record=NOT_RECORDED,
        ),
    ] = []
    otlp_receive: Annotated[
        str | None,
        Flag(
            "receive the server's OpenTelemetry spans (OTLP/gRPC) here during the run and join "
            "them to the requests by trace id: TTFT split before, inside and after the server's "
            "span (point the server at it, e.g. cadence serve or vllm serve "
            "--otlp-traces-endpoint http://127.0.0.1:PORT); HOST defaults to 127.0.0.1 (default: "
            "off)",
            MEASURE,
            commands=(BENCH,),
            metavar="[HOST:]PORT",
            record=NOT_RECORDED,
        ),
    ] = None
    otlp_wait: Annotated[
        float,
        Flag(
            "after the run, wait up to S seconds for the last spans (a server's batch processor "
            "sends every few seconds)",
            MEASURE,
            commands=(BENCH,),
            metavar="S",
            record=NOT_RECORDED,
        ),
    ] = 10.0


SERVER_VARIABLES = {
    "queue_capacity": "--queue-capacity",
    "max_concurrent": "--max-concurrent",
    "max_batch": "--max-batch",
    "step_ms": "--step-ms",
    "jitter_ms": "--jitter-ms",
    "overflow": "--overflow",
    "workers": "--devices",
    "engine_threads": "--engine-threads",
    "fronts": "--fronts",
}
"""What `cadence sweep --vary` may change of the servers it starts, and the `cadence serve`
flag each sets."""


class RunOptions(msgspec.Struct, kw_only=True):
    """What each command runs against, how often, and where it writes what it found."""

    target: Annotated[
        str | None,
        Flag(
            {
                BENCH: "HOST:PORT of the server (--protocol openai: http://HOST:PORT)",
                SWEEP: "sweep the load against this running server, restarting nothing (--protocol "
                "openai: http://HOST:PORT); default: a fresh server per run",
                CAPACITY: "HOST:PORT of the running server (--protocol openai: http://HOST:PORT)",
            },
            required=(BENCH, CAPACITY),
            metavar="HOST:PORT",
            record={"target": DERIVED},
        ),
    ] = None
    vary: Annotated[
        list[str],
        Flag(
            "the variable and its values; repeat it for a grid of every combination. The "
            f"server's: {', '.join(SERVER_VARIABLES)} (engine_threads: the app engine's); with "
            "--server-cmd, any {NAME} of the command. The load's (named as the flags below): "
            f"{', '.join(client_variables())}",
            commands=(SWEEP,),
            required=(SWEEP,),
            metavar="NAME=V1,V2,...",
            record=NOT_RECORDED,
        ),
    ] = []
    search: Annotated[
        Literal["concurrency", "rate"],
        Flag(
            "what to raise: streams at once (closed loop) or requests/s (open loop)",
            commands=(CAPACITY,),
            required=(CAPACITY,),
            record=NOT_RECORDED,
        ),
    ] = "concurrency"
    low: Annotated[
        float, Flag("the smallest load tried", commands=(CAPACITY,), record=NOT_RECORDED)
    ] = 1.0
    high: Annotated[
        float, Flag("the largest load tried", commands=(CAPACITY,), record=NOT_RECORDED)
    ] = 256.0
    repeat: Annotated[
        int,
        Flag(
            {
                BENCH: "run the workload N times back to back: the JSON's `repeats` holds each key "
                "figure's value per run, mean and 95% confidence interval (the rest is the "
                "first run's), and `cadence report a.json b.json --fail-if` then judges a "
                "regression only outside that noise",
                SWEEP: "runs per point",
                CAPACITY: "runs per load; a load passes only when every run does",
            },
            parse=_positive,
            metavar="N",
            record=NOT_RECORDED,
        ),
    ] = 1
    confirm_runs: Annotated[
        int,
        Flag(
            "runs at each load around the knee once it is found (the largest passing, the "
            "smallest failing, and one a step beyond each): the answer holds on all of them; "
            "1 confirms nothing",
            commands=(CAPACITY,),
            parse=_positive,
            metavar="N",
            record=NOT_RECORDED,
        ),
    ] = 3
    serve_args: Annotated[
        str,
        Flag(
            "arguments of `cadence serve` that stay fixed (quoted)",
            SERVERS,
            commands=(SWEEP,),
            record=NOT_RECORDED,
        ),
    ] = SERVE_ARGS
    server_cmd: Annotated[
        str | None,
        Flag(
            "sweep a server of your own instead: a shell command with {port} (a free port) and "
            "{NAME} (the varied value) replaced; it runs in its own process group, stopped with "
            "SIGTERM (SIGKILL after 5 s)",
            SERVERS,
            commands=(SWEEP,),
            metavar="COMMAND",
            record=NOT_RECORDED,
        ),
    ] = None
    ready_timeout: Annotated[
        float,
        Flag(
            "--server-cmd: how long to wait for the server to answer gRPC (health SERVING, or any "
            "answer when it has no health service)",
            SERVERS,
            commands=(SWEEP,),
            metavar="S",
            record=NOT_RECORDED,
        ),
    ] = 60.0
    json_path: Annotated[
        str | None,
        Flag(
            {
                BENCH: "write every aggregate and raw record here",
                SWEEP: "write the sweep's results here",
                CAPACITY: "write the search here",
            },
            flag="--json",
            record=NOT_RECORDED,
        ),
    ] = None
    csv_path: Annotated[
        str | None,
        Flag(
            "write one row per point here: its values, the table's metrics, the diagnosis rules",
            commands=(SWEEP,),
            flag="--csv",
            metavar="PATH",
            record=NOT_RECORDED,
        ),
    ] = None
    report: Annotated[
        str | None,
        Flag(
            "render plots and an HTML report into this folder",
            commands=(SWEEP,),
            record=NOT_RECORDED,
        ),
    ] = None
    export: Annotated[
        str | None,
        Flag(
            "also write one row per request (ids, tokens, TTFT, ITL, dispatch delay, ...): CSV "
            "when FILE ends in .csv, Parquet in .parquet (the parquet extra), else JSONL",
            commands=(BENCH,),
            metavar="FILE",
            record=NOT_RECORDED,
        ),
    ] = None
    no_progress: Annotated[
        bool,
        Flag(
            "no progress bar (there is none anyway when stderr is not a terminal)",
            commands=(BENCH,),
            record=NOT_RECORDED,
        ),
    ] = False


DECLARING = (RunOptions, ProtocolOptions, WorkloadOptions, MeasureOptions)
"""Every struct that declares lab options, in the order their flags are shown; the client's
security flags (cadence.credentials.add_arguments, shared with `cadence generate`) come after
the protocol's."""


def lab_options(command: str) -> list[LabOption]:
    """Every declared option that `command` takes, in the order its help shows them."""
    return [o for cls in DECLARING for o in declared(cls) if command in o.declared.commands]


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add `command`'s flags to its parser as their fields declare them, each in its section
    of the help."""
    from cadence.credentials import add_arguments

    sections: dict[str, Any] = {GENERAL: parser}
    exclusive: dict[str, Any] = {}
    for cls in DECLARING:
        for option in declared(cls):
            flag = option.declared
            if command not in flag.commands:
                continue
            group = sections.get(flag.section) or sections.setdefault(
                flag.section, parser.add_argument_group(flag.section)
            )
            if flag.exclusive:
                group = exclusive.get(flag.exclusive) or exclusive.setdefault(
                    flag.exclusive, group.add_mutually_exclusive_group()
                )
            group.add_argument(option.flag, **option.argument(command))
        if cls is ProtocolOptions:
            add_arguments(parser)  # the client's security, shared with `cadence generate`
