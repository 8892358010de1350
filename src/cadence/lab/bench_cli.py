"""The `cadence bench` command line."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadence.lab.results import BenchResult


def _length(text: str):
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


def read_prompts(path: str) -> list[tuple[list[int], int]]:
    """A JSONL file, one {"prompt": str, "max_tokens": int (optional)} per line."""
    from cadence.byte_tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompts.append((tokenizer.encode(item["prompt"]), int(item.get("max_tokens", 0))))
            except (ValueError, KeyError, TypeError) as exc:
                raise SystemExit(f"cadence bench: {path}:{n}: expected {{\"prompt\": ...}}: {exc}")
    if not prompts:
        raise SystemExit(f"cadence bench: {path} holds no prompts")
    return prompts


EXIT_RUN_FAILED = 1
"""The run cannot stand for the server (it stopped early, or no request succeeded), or it
could not start (a bad option, an unreachable target)."""
EXIT_INTEGRITY = 3
"""The run went through but the output was not whole: tokens lost, repeated or reordered, or
streams that ended short (the `integrity_faults` finding), among the checks its protocol
counts. The summary and the JSON are written first."""
EXIT_CODES = (f"exit status: 0 the run went through (whatever its verdict); {EXIT_RUN_FAILED} "
              "it cannot stand for the server (stopped early, every request failed) or could "
              "not start; 2 a usage error; "
              f"{EXIT_INTEGRITY} the output was not whole (lost, repeated or reordered tokens, "
              "short streams)")


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure a running server: TTFT, ITL, tails, segments",
                       epilog=EXIT_CODES)
    p.add_argument("--target", required=True,
                   help="HOST:PORT of the server (--protocol openai: http://HOST:PORT)")
    add_protocol_args(p)
    add_workload_args(p)
    p.add_argument("--server-pid", type=int, default=None, metavar="PID",
                   help="the server process whose CPU to sample (default: cadence's processes, "
                        "or the process listening on a local target's port)")
    p.add_argument("--baseline", action="store_true",
                   help="also run the workload through the engine alone (local server only) "
                        "and report serving overhead")
    p.add_argument("--slo", action="append", default=[], metavar="METRIC_STAT_ms=BOUND",
                   help="a latency SLO term, repeatable (e.g. --slo ttft_p99_ms=150 --slo "
                        "itl_p99_ms=40; METRIC ttft, itl, tpot, e2e or token_delay, STAT p50, "
                        "p90, p99 or max): goodput counts the requests that meet every term, "
                        "and the run passes when its percentiles do (default: none)")
    add_scrape_args(p)
    p.add_argument("--otlp-receive", default=None, metavar="[HOST:]PORT",
                   help="receive the server's OpenTelemetry spans (OTLP/gRPC) here during the "
                        "run and join them to the requests by trace id: TTFT split before, "
                        "inside and after the server's span (point the server at it, e.g. "
                        "cadence serve or vllm serve --otlp-traces-endpoint "
                        "http://127.0.0.1:PORT); HOST defaults to 127.0.0.1 (default: off)")
    p.add_argument("--otlp-wait", type=float, default=10.0, metavar="S",
                   help="after the run, wait up to S seconds for the last spans (a server's "
                        "batch processor sends every few seconds)")
    p.add_argument("--json", dest="json_path", default=None, help="write every aggregate and raw record here")
    p.add_argument("--repeat", type=_positive, default=1, metavar="N",
                   help="run the workload N times back to back: the JSON's `repeats` holds each "
                        "key figure's value per run, mean and 95%% confidence interval (the "
                        "rest is the first run's), and `cadence report a.json b.json "
                        "--fail-if` then judges a regression only outside that noise")
    p.add_argument("--export", default=None, metavar="FILE",
                   help="also write one row per request (ids, tokens, TTFT, ITL, dispatch "
                        "delay, ...): CSV when FILE ends in .csv, Parquet in .parquet (the "
                        "parquet extra), else JSONL")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway when stderr is not a terminal)")
    p.set_defaults(func=_bench)


def add_scrape_args(p: argparse.ArgumentParser) -> None:
    """`--scrape`; shared by bench and capacity."""
    p.add_argument("--scrape", action="append", default=[], metavar="URL",
                   help="a Prometheus metrics page of any server (e.g. vLLM's "
                        "http://HOST:8000/metrics), repeatable: read every 0.5 s during the "
                        "run, its gauges and counters' rates kept on the run's time axis "
                        "(JSON `scraped`), and the requests running, waiting and the KV cache "
                        "in use of vLLM, SGLang, Triton and cadence given to the diagnosis; "
                        "checked before the run (default: none)")


def check_scrapes(urls: list[str], command: str) -> None:
    """Read each `--scrape` page once; exits with one line when one cannot be read, before
    any load goes out."""
    from cadence.lab.measure.prometheus import ScrapeError, check_scrape_url

    for url in urls:
        try:
            check_scrape_url(url)
        except ScrapeError as exc:
            sys.exit(f"cadence {command}: --scrape {url}: {exc}")


def add_protocol_args(p: argparse.ArgumentParser) -> None:
    """The options that say how to talk to the server; shared by bench and sweep."""
    p.add_argument("--protocol", choices=["cadence", "kserve", "grpc", "openai"],
                   default="cadence",
                   help="cadence.v1.Inference/Generate (default), the Open Inference Protocol "
                        "(KServe v2 / Triton gRPC, ModelStreamInfer) of any server that speaks "
                        "it, any gRPC streaming method (--method, --request-json), or the OpenAI "
                        "HTTP API with SSE of any server that speaks it (docs/openai.md)")
    p.add_argument("--model", default="cadence",
                   help="--protocol kserve or openai: the model to drive (default: cadence's "
                        "own)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="--protocol openai: /v1/completions (default) or /v1/chat/completions")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="--protocol openai: a Hugging Face tokenizer folder (its "
                        "tokenizer.json, on this host): another server's output is counted "
                        "in its tokens rather than by events or the server's usage")
    p.add_argument("--kserve-inputs", default="PROMPT_TOKEN_IDS=prompt,MAX_TOKENS=max_tokens",
                   metavar="NAME=SOURCE,...",
                   help="--protocol kserve: the model's INT32 inputs; SOURCE is prompt (the "
                        "prompt's token ids), max_tokens, or an integer (e.g. "
                        "'N=max_tokens,DELAY_MS=10' for the PyTriton peer), each optionally "
                        "followed by :batched (a leading batch dimension of one, for a "
                        "Triton model with batching)")
    g = p.add_argument_group("--protocol grpc (any server-streaming or bidirectional method)")
    g.add_argument("--method", default=None, metavar="PACKAGE.SERVICE/METHOD",
                   help="the method to drive")
    g.add_argument("--request-json", default=None, metavar="JSON",
                   help='the request in the proto3 JSON mapping; whole string values '
                        '"{max_tokens}", "{prompt}", "{request_id}" and "{i}" are replaced per '
                        'request')
    g.add_argument("--proto", action="append", default=[], metavar="FILE",
                   help="the service's .proto file (repeatable), when the server offers no "
                        "reflection")
    g.add_argument("--proto-path", action="append", default=[], metavar="DIR",
                   help="where --proto files and their imports are found (repeatable)")
    g.add_argument("--tokens-field", default="", metavar="NAME",
                   help="the response field that holds its tokens (a repeated field counts its "
                        "elements, a number is a count, a string is one); default: one message "
                        "is one token")
    g.add_argument("--index-field", default="", metavar="NAME",
                   help="the response field that numbers the output (the position of the "
                        "message's first token, or the message's number without "
                        "--tokens-field): turns on the lost/repeated/reordered checks")
    g.add_argument("--header", action="append", default=[], metavar="KEY=VALUE",
                   help="metadata sent with every call (repeatable), e.g. authorization=...")
    from cadence.credentials import add_arguments

    add_arguments(p)


def protocol_from_args(args: argparse.Namespace, command: str):
    """(kserve target, None) or (None, a function that resolves the gRPC target against a
    server's address) or (None, None) for cadence's protocol; exits with one line when the
    options do not fit together."""
    if args.protocol == "kserve":
        from cadence.lab.load.kserve import KServeTarget, parse_inputs

        try:
            return KServeTarget(args.model, parse_inputs(args.kserve_inputs)), None
        except ValueError as exc:
            sys.exit(f"cadence {command}: --kserve-inputs: {exc}")
    grpc_only = ("method", "request_json", "proto", "proto_path", "tokens_field", "index_field",
                 "header")
    if args.protocol != "grpc":
        given = [f"--{n.replace('_', '-')}" for n in grpc_only if getattr(args, n)]
        if given:
            sys.exit(f"cadence {command}: {', '.join(given)} need --protocol grpc")
        return None, None
    if not args.method or args.request_json is None:
        sys.exit(f"cadence {command}: --protocol grpc needs --method PACKAGE.SERVICE/METHOD and "
                 "--request-json JSON")
    from cadence.lab.load.grpc_service import headers_of

    try:
        headers = headers_of(args.header)
    except ValueError as exc:
        sys.exit(f"cadence {command}: {exc}")
    return None, lambda target, credentials: _grpc_target(args, target, credentials, headers)


def openai_from_args(args: argparse.Namespace, command: str):
    """The OpenAI target of `--protocol openai` (None for another protocol); exits with one
    line when `--target` is not an http(s) URL."""
    if args.protocol != "openai":
        if getattr(args, "tokenizer", None):
            sys.exit(f"cadence {command}: --tokenizer needs --protocol openai")
        return None
    from cadence.lab.load.openai_http import OpenAITarget

    target = args.target or ""  # a sweep without --target: each server's own
    if target and not target.startswith(("http://", "https://")):
        sys.exit(f"cadence {command}: --protocol openai needs --target http://HOST:PORT")
    token = ""
    if getattr(args, "token_file", None):
        from cadence.api.security import read_tokens

        token = read_tokens(args.token_file)[0]
    tokenizer = getattr(args, "tokenizer", None) or ""
    if tokenizer:
        from cadence.lab.load.openai_http import token_counter

        try:
            token_counter(tokenizer)
        except ValueError as exc:
            sys.exit(f"cadence {command}: {exc}")
    return OpenAITarget(target.rstrip("/"), args.model, args.endpoint, token, tokenizer)


def _grpc_target(args: argparse.Namespace, target: str, credentials, headers):
    """Resolve the method (reflection or protos) and check the request: SchemaError if not."""
    from cadence.lab.load import grpc_schema
    from cadence.lab.load.grpc_service import GrpcTarget, check_request

    if args.proto:
        schema = grpc_schema.from_protos(args.proto, args.proto_path, args.method)
    else:
        with credentials.channel(target) as channel:
            schema = grpc_schema.from_reflection(channel, args.method, metadata=headers)
    grpc = GrpcTarget(schema=schema, request_json=args.request_json,
                      tokens_field=args.tokens_field, index_field=args.index_field,
                      headers=headers)
    check_request(grpc, workload_from_args(args).shape.request(0))
    return grpc


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The options that say what load to send; shared by bench and sweep."""
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=64, help="streams open at once (closed loop)")
    load.add_argument("--rate", type=_rate, default=None, metavar="R|LO:HI",
                      help="requests/s, Poisson arrivals (open loop); LO:HI with --ramp: "
                           "rising from LO to HI")
    load.add_argument("--stages", type=_stages, default=None, metavar="R:S,R:S,...",
                      help="open loop in steps: R requests/s for S seconds, then the next; "
                           "the run ends with the last")
    load.add_argument("--trace", default=None, metavar="FILE",
                      help="replay a trace (open loop, each request at its time): JSONL or CSV "
                           "rows of timestamp (ms), input_length, output_length and optionally "
                           "hash_ids (Mooncake: prompts that share blocks share prefixes) and "
                           "session_id")
    load.add_argument("--sessions", type=_positive, default=None, metavar="N",
                      help="N conversations at once, each --turns turns: every turn sends the "
                           "history and a new user message (--prompt-tokens long; the "
                           "answers in the history are stand-ins --max-tokens long)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests in all (default: --concurrency, unless --duration is given)")
    p.add_argument("--duration", type=float, default=None, help="stop sending new requests after S seconds")
    p.add_argument("--max-tokens", type=_length, default="128",
                   help="N, LO:HI (uniform), normal:MEAN,SD, lognormal:MEAN,SD (either with "
                        ",MIN,MAX) or empirical:FILE (one length a line)")
    p.add_argument("--prompt-tokens", type=_length, default="16",
                   help="as --max-tokens, for the prompt")
    p.add_argument("--prompts", default=None, help='JSONL file of {"prompt": ..., "max_tokens": ...}')
    p.add_argument("--class", dest="classes", action="append", default=[], type=_request_class,
                   metavar="'NAME prompt=LEN max=LEN slo=TERM,...'",
                   help="a request class for --mix (repeatable): its name, then its prompt and "
                        "output lengths (as --prompt-tokens and --max-tokens; default theirs) "
                        "and optionally its own SLO terms (as --slo), separated by spaces, "
                        "e.g. --class 'chat prompt=128 max=64 slo=ttft_p99_ms=200'")
    p.add_argument("--mix", type=_mix_shares, default=None, metavar="NAME:SHARE%,...",
                   help="send the --class classes in these shares (e.g. "
                        "'chat:70%%,summarize:30%%'; they add up to 100%%): results by class")
    p.add_argument("--ramp", type=_duration, default=None, metavar="S",
                   help="with --rate LO:HI: the rate rises linearly from LO to HI over S "
                        "seconds (e.g. 120s), then holds")
    p.add_argument("--saturation-stop", type=_duration, nargs="?", const=2.0, default=None,
                   metavar="WINDOW_S",
                   help="with --rate LO:HI --ramp S or --stages: end the run once the server "
                        "no longer keeps up (in windows of WINDOW_S seconds, default 2: the "
                        "achieved rate more than 10%% under the offered one while TTFT p50 "
                        "grows past twice its floor, two windows in a row) and report the "
                        "knee's rate (JSON `saturation`)")
    p.add_argument("--warmup-duration", type=_duration, default=0.0, metavar="S",
                   help="the requests sent in the run's first S seconds are sent but not "
                        "counted")
    p.add_argument("--trace-speed", type=_speed, default=1.0, metavar="X",
                   help="--trace: play it X times as fast (0.5: half as fast)")
    p.add_argument("--trace-window", type=_window, default=None, metavar="START:END",
                   help="--trace: only the rows from START to END seconds after its first "
                        "(either may be left out), the replay starting at START")
    p.add_argument("--trace-block-tokens", type=_positive, default=512, metavar="N",
                   help="--trace: tokens per hash_ids block (Mooncake's: 512)")
    p.add_argument("--turns", type=_positive, default=None, metavar="K",
                   help="--sessions: turns per conversation (default 3)")
    p.add_argument("--think-ms", type=_seconds, default=0.0, metavar="D",
                   help="--sessions: pause between a turn's end and the next turn")
    p.add_argument("--session-header", default="", metavar="NAME",
                   help="send each request's session id in this header (gRPC metadata, HTTP "
                        "header), for a server or proxy that routes a session to one replica "
                        "(--sessions, or a --trace with session_id)")
    p.add_argument("--seed", type=int, default=0, help="seed of the requests' lengths and prompts")
    p.add_argument("--warmup", type=int, default=0, help="requests per process sent first, not counted")
    p.add_argument("--timeout", type=float, default=None, help="per-request deadline (s)")
    p.add_argument("--stall-limit", type=_seconds, default=None, metavar="S",
                   help="end a request that gets no message for S seconds (its first counted "
                        "from its start) as failed, code STALLED (default: 60 without "
                        "--timeout, none with it; 0: none)")
    p.add_argument("--procs", type=int, default=1, help="load-generating processes")
    p.add_argument("--channels", type=int, default=1, help="gRPC connections per process")
    p.add_argument("--read-delay-ms", type=_share_of, default=(0.0, 1.0), metavar="MS[@SHARE%]",
                   help="pause after each chunk, to play a slow-reading client; with @SHARE%% "
                        "only that share of the requests (the slow_reader population)")
    p.add_argument("--cancel-ms", type=_share_of, default=None, metavar="MS@SHARE%",
                   help="cancel that share of the requests MS after their send, mid-stream "
                        "(the cancelling population; counted apart from errors)")
    p.add_argument("--deadline-ms", type=_share_of, default=None, metavar="MS@SHARE%",
                   help="give that share of the requests a deadline of MS (the deadline "
                        "population)")
    p.add_argument("--no-timing", action="store_true", help="do not ask for server timestamps")


def workload_from_args(args: argparse.Namespace):
    """The Workload that `add_workload_args` options describe."""
    from cadence.lab.bench import Workload
    from cadence.lab.load.plan import Conversation, RequestShape

    requests, concurrency = args.requests, args.concurrency
    trace, described = _trace_of(args)
    conversation = None
    if args.sessions is not None:
        turns = args.turns or 3
        conversation = Conversation(args.sessions, turns, args.think_ms)
        requests, concurrency = min(requests or args.sessions * turns,
                                    args.sessions * turns), args.sessions
    elif args.turns is not None or args.think_ms:
        sys.exit("cadence bench: --turns and --think-ms need --sessions")
    if trace:
        requests = min(requests or len(trace), len(trace))
    rate, stages = _rate_shape(args)
    if requests is None and args.duration is None:
        if rate is not None and not (stages and stages[-1][2] != math.inf):
            sys.exit("cadence bench: with --rate, give --requests or --duration")
        if not stages:
            requests = concurrency
    return Workload(
        requests=requests,
        concurrency=concurrency,
        rate=rate,
        stages=stages,
        warmup_s=args.warmup_duration,
        duration_s=args.duration,
        shape=RequestShape(
            prompt_tokens=_bounds(args.prompt_tokens),
            max_tokens=_bounds(args.max_tokens),
            prompt_lengths=_distribution(args.prompt_tokens),
            output_lengths=_distribution(args.max_tokens),
            prompts=read_prompts(args.prompts) if args.prompts else [],
            seed=args.seed,
            trace=trace,
            block_tokens=args.trace_block_tokens,
            conversation=conversation,
            session_header=args.session_header.strip().lower(),
            clients=_client_mix(args),
            mix=_class_mix(args),
        ),
        trace=described,
        include_timing=not args.no_timing,
        timeout_s=args.timeout,
        stall_s=args.stall_limit,
        warmup=args.warmup,
        read_delay_ms=args.read_delay_ms[0] if args.read_delay_ms[1] == 1.0 else 0.0,
        saturation_window_s=_saturation_window(args, stages),
    )


_CLASS_KEYS = ("prompt", "max", "slo")


def _request_class(text: str):
    """`NAME prompt=LEN max=LEN slo=TERM,...`: a RequestClass (lengths unset: the run's)."""
    from cadence.lab.analysis.goodput import parse_term

    name, *fields = text.split()
    given: dict[str, str] = {}
    for item in fields:
        key, sep, value = item.partition("=")
        if not sep or key not in _CLASS_KEYS or not value:
            raise argparse.ArgumentTypeError(
                f"expected 'NAME prompt=LEN max=LEN slo=TERM,...', got {item!r} in {text!r}")
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
            raise argparse.ArgumentTypeError(f"expected NAME:SHARE%,... (e.g. chat:70%,"
                                             f"summarize:30%), got {part!r}")
        shares.append((name, value))
    if abs(sum(v for _, v in shares) - 1.0) > 1e-6:
        raise argparse.ArgumentTypeError(f"the shares of --mix add up to "
                                         f"{sum(v for _, v in shares):.0%}, not 100%")
    return shares


def _class_mix(args: argparse.Namespace):
    """The ClassMix of `--mix` and `--class`; None without them. Exits when they do not fit."""
    if args.mix is None:
        if args.classes:
            sys.exit("cadence bench: --class needs --mix (the classes' shares)")
        return None
    if args.prompts or args.trace or args.sessions:
        sys.exit("cadence bench: --mix makes the requests itself: not with --prompts, --trace "
                 "or --sessions")
    from cadence.lab.load.plan import ClassMix, RequestClass

    defined = {name: (prompt, out, slo) for name, prompt, out, slo in args.classes}
    classes = []
    for name, _ in args.mix:
        if name not in defined:
            sys.exit(f"cadence bench: --mix names {name!r}, but no --class defines it")
        prompt, out, slo = defined[name]
        lengths = {}
        for key, text, default in (("prompt", prompt, args.prompt_tokens),
                                   ("max", out, args.max_tokens)):
            try:
                lengths[key] = _length(text) if text else default
            except argparse.ArgumentTypeError as exc:
                sys.exit(f"cadence bench: --class {name}: {key}={text}: {exc}")
        classes.append(RequestClass(
            name=name, prompt_tokens=_bounds(lengths["prompt"]),
            max_tokens=_bounds(lengths["max"]), prompt_lengths=_distribution(lengths["prompt"]),
            output_lengths=_distribution(lengths["max"]), slo=slo))
    return ClassMix(classes=classes, shares=[share for _, share in args.mix])


def _saturation_window(args: argparse.Namespace, stages) -> float:
    """`--saturation-stop`'s window (0 without it); exits when the load does not rise."""
    window = getattr(args, "saturation_stop", None)
    if window is None:
        return 0.0
    if not stages:
        sys.exit("cadence bench: --saturation-stop needs a rising load: --rate LO:HI --ramp S "
                 "or --stages")
    if not window > 0:
        sys.exit("cadence bench: --saturation-stop takes a window above 0 seconds")
    return window


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


def _client_mix(args: argparse.Namespace):
    """The populations of `--read-delay-ms MS@SHARE%`, `--cancel-ms`, `--deadline-ms`; None
    when every request behaves alike. Exits when the shares add up to more than all."""
    from cadence.lab.load.plan import ClientMix

    read_delay = args.read_delay_ms if args.read_delay_ms[1] < 1.0 else (0.0, 0.0)
    cancel, deadline = args.cancel_ms or (0.0, 0.0), args.deadline_ms or (0.0, 0.0)
    if not (read_delay[1] or cancel[1] or deadline[1]):
        return None
    if read_delay[1] + cancel[1] + deadline[1] > 1.0 + 1e-9:
        sys.exit("cadence bench: the shares of --read-delay-ms, --cancel-ms and --deadline-ms "
                 "add up to more than 100%")
    return ClientMix(read_delay=read_delay, cancel=cancel, deadline=deadline)


def _rate(text: str) -> float | tuple[float, float]:
    """`R` or `LO:HI` requests/s."""
    lo, sep, hi = text.partition(":")
    try:
        rates = (float(lo), float(hi)) if sep else (float(lo),)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R or LO:HI requests/s, got {text!r}") from None
    if not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected rates above 0, got {text!r}")
    return rates if sep else rates[0]


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
                f"expected RATE:SECONDS,... (e.g. 10:30,50:30), got {part!r}")
        stages.append((r, r, s))
    return stages


def _rate_shape(args: argparse.Namespace) -> tuple[float | None, list]:
    """(rate, stages) of `--rate`, `--ramp` and `--stages`; exits when they do not fit."""
    if args.stages:
        if args.ramp is not None:
            sys.exit("cadence bench: --ramp goes with --rate LO:HI, not --stages")
        return max(r for r, _, _ in args.stages), args.stages
    if isinstance(args.rate, tuple):
        if args.ramp is None:
            sys.exit("cadence bench: --rate LO:HI needs --ramp S (how long the rise takes)")
        lo, hi = args.rate
        return hi, [(lo, hi, args.ramp), (hi, hi, math.inf)]
    if args.ramp is not None:
        sys.exit("cadence bench: --ramp needs --rate LO:HI")
    return args.rate, []


def _bounds(length) -> tuple[int, int]:
    """The (LO, HI) of a length option: its range, or the bounds of its distribution."""
    return length if isinstance(length, tuple) else length.bounds


def _distribution(length):
    """The distribution of a length option (None for N or LO:HI)."""
    return None if isinstance(length, tuple) else length


def _trace_of(args: argparse.Namespace):
    """(trace rows, their description) of `--trace`; ([], None) without it;
    exits with one line when the file cannot be read or the options do not fit."""
    if args.trace is None:
        if args.trace_speed != 1.0 or args.trace_window is not None:
            sys.exit("cadence bench: --trace-speed and --trace-window need --trace")
        return [], None
    if args.prompts:
        sys.exit("cadence bench: --trace and --prompts both say what to send: give one")
    from cadence.lab.bench import described_trace
    from cadence.lab.load.plan import RequestShape
    from cadence.lab.load.trace import TraceError, numbered_trace

    window = args.trace_window or (0.0, None)
    try:
        numbered = numbered_trace(args.trace, args.trace_speed, window)
    except TraceError as exc:
        for line in str(exc).splitlines():
            print(f"cadence bench: {line}", file=sys.stderr)
        sys.exit(2)
    _say_replay_length(args, numbered)
    rows = [row for _, row in numbered]
    shape = RequestShape(trace=rows, block_tokens=args.trace_block_tokens)
    return rows, described_trace(shape, args.trace, args.trace_speed, window)


REPLAY_LIMIT_S = 3600.0
"""The longest trace replay run without `--duration`: past it the trace is refused, since a
mistyped time (seconds for ms, one row years ahead) would otherwise wait in silence."""


def _say_replay_length(args: argparse.Namespace, numbered: list) -> None:
    """Say on stderr how long the replay will take and its longest pause (an operator never
    watches a silent wait); exit 2 when it would outlast REPLAY_LIMIT_S without a
    `--duration` that allows it."""
    sent = numbered[:args.requests] if args.requests else numbered
    if args.duration is not None:
        sent = [(n, row) for n, row in sent if row.offset_s <= args.duration]
    pause, before = 0.0, None
    for (_, earlier), (n, later) in itertools.pairwise(sent):
        if later.offset_s - earlier.offset_s > pause:
            pause, before = later.offset_s - earlier.offset_s, n
    span = sent[-1][1].offset_s if sent else 0.0
    longest = f"; the longest pause: {pause:g} s, before row {before}" if before else ""
    if args.duration is None and span > REPLAY_LIMIT_S:
        print(f"cadence bench: --trace {args.trace}: the replay would take {span:g} s{longest}; "
              f"give --duration S to replay that long, or cut it with --trace-window, "
              f"--trace-speed or --requests", file=sys.stderr)
        sys.exit(2)
    cut = len(numbered[:args.requests] if args.requests else numbered) - len(sent)
    print(f"cadence bench: replaying {len(sent)} requests of {args.trace} over {span:g} s"
          + (longest if pause >= 60 else "")
          + (f" (--duration {args.duration:g} leaves out {cut} later rows)" if cut else ""),
          file=sys.stderr)


def _bench(args: argparse.Namespace) -> None:
    from cadence.lab.bench import run_bench
    from cadence.lab.load.processes import RequestCounter
    from cadence.lab.load.progress import BenchProgress, progress_wanted
    from cadence.lab.output_paths import check_outputs, writing
    from cadence.lab.report.summary import print_summary

    check_outputs("bench", {"--json": args.json_path, "--export": args.export})
    if args.export:
        from cadence.lab.report.export import ExportError, check

        try:
            check(args.export)
        except ExportError as exc:
            sys.exit(f"cadence bench: --export {exc}")
    traces = _trace_receiver(args.otlp_receive) if args.otlp_receive else None
    workload, credentials, slo, protocol = bench_inputs(args, "bench")
    counter, shown = None, contextlib.nullcontext()
    if progress_wanted(args.no_progress):
        counter = RequestCounter()
        shown = BenchProgress(counter, workload.requests, workload.duration_s)
    runs = []
    try:
        for _ in range(args.repeat):
            with shown:
                runs.append(run_bench(args.target, workload, processes=args.procs,
                                      channels=args.channels, baseline=args.baseline,
                                      credentials=credentials, protocol=protocol,
                                      counter=counter, server_pid=args.server_pid, slo=slo,
                                      scrape=args.scrape, traces=traces,
                                      traces_wait_s=args.otlp_wait))
            if _failed(runs[-1]):
                break
            if counter is not None:  # each run its own bar
                counter = RequestCounter()
                shown = BenchProgress(counter, workload.requests, workload.duration_s)
    except RuntimeError as exc:
        sys.exit(f"cadence bench: {exc}")
    finally:
        if traces is not None:
            traces.stop()
    result = runs[0] if not _failed(runs[-1]) else runs[-1]
    if len(runs) > 1 and not _failed(runs[-1]):
        from cadence.lab.analysis.noise import repeats

        result.repeats = repeats(runs)
    print_summary(result)
    if args.export:
        from cadence.lab.report.export import write

        with writing("bench", "--export", args.export):
            write(args.export, result.records or [])
    if args.json_path:
        from cadence.lab.results import to_builtins

        with writing("bench", "--json", args.json_path), open(args.json_path, "w") as f:
            json.dump(to_builtins(result), f)
    failed = _failed(result)
    if failed:
        sys.exit(f"cadence bench: {failed}")
    broken = integrity_faults(result)
    if broken:
        print(f"cadence bench: the output was not whole: {broken}", file=sys.stderr)
        sys.exit(EXIT_INTEGRITY)


def integrity_faults(result: BenchResult) -> str | None:
    """The integrity faults of the run, in words (among the checks its protocol counts);
    None when its output was whole."""
    from cadence.lab.analysis.integrity import faults

    found = faults(result.integrity, result.workload)
    return ", ".join(f"{name} {count}" for name, count in found.items()) or None


def _trace_receiver(where: str):
    """A started OTLP trace receiver on `[HOST:]PORT`; exits with one line when it cannot."""
    from cadence.lab.measure.trace_receiver import TraceReceiver, otlp_available

    problem = otlp_available()
    if problem is not None:
        sys.exit(f"cadence bench: {problem}")
    host, _, port = where.rpartition(":")
    try:
        receiver = TraceReceiver(int(port), host or "127.0.0.1")
        receiver.start()
    except ValueError:
        sys.exit(f"cadence bench: --otlp-receive takes [HOST:]PORT, got {where!r}")
    except (OSError, RuntimeError) as exc:
        sys.exit(f"cadence bench: cannot receive traces on {where}: {exc}")
    print(f"receiving OTLP traces on {host or '127.0.0.1'}:{receiver.port}", file=sys.stderr)
    return receiver


def bench_inputs(args: argparse.Namespace, command: str):
    """(workload, credentials, SLO terms, protocol) for a run against `args.target`; exits
    with one line when one of them cannot be had."""
    from cadence.credentials import from_arguments
    from cadence.lab.analysis.goodput import parse_term

    workload = workload_from_args(args)
    try:
        credentials = from_arguments(args)
        slo = [parse_term(text) for text in args.slo]
    except ValueError as exc:
        sys.exit(f"cadence {command}: {exc}")
    check_scrapes(args.scrape, command)
    return workload, credentials, slo, running_protocol(args, command, credentials)


def running_protocol(args: argparse.Namespace, command: str, credentials):
    """The protocol to speak to the running server at `args.target`, checked to answer it
    (one probe request); exits with one line when it does not."""
    from cadence.lab.load.cadence_v1 import CadenceTarget
    from cadence.lab.load.grpc_schema import SchemaError
    from cadence.lab.load.probe import require_protocol
    from cadence.lab.servers.readiness import require_reachable

    kserve, resolve = protocol_from_args(args, command)
    openai = openai_from_args(args, command)
    try:
        if openai is None:
            require_reachable(args.target, credentials)
        else:
            from cadence.lab.load.openai_http import require_http

            require_http(openai)
        grpc = resolve(args.target, credentials) if resolve else None
        protocol = openai or grpc or kserve or CadenceTarget()
        require_protocol(protocol, args.target, credentials)
    except (RuntimeError, SchemaError) as exc:
        sys.exit(f"cadence {command}: {exc}")
    return protocol


def _failed(result: BenchResult) -> str | None:
    """Why the run's figures cannot stand for the server (the exit status is then non-zero):
    it stopped early, or not one request succeeded."""
    if result.aborted:
        return result.aborted
    if result.requests and not result.requests_ok:
        return f"every request failed ({', '.join(result.errors_by_code)})"
    return None
