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
                raise SystemExit(
                    f'cadence bench: {path}:{n}: expected {{"prompt": ...}}: {exc}'
                ) from None
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
EXIT_CODES = (
    f"exit status: 0 the run went through (whatever its verdict); {EXIT_RUN_FAILED} "
    "it cannot stand for the server (stopped early, every request failed) or could "
    "not start; 2 a usage error; "
    f"{EXIT_INTEGRITY} the output was not whole (lost, repeated or reordered tokens, "
    "short streams, extra SSE events)"
)


def add_bench(sub: argparse._SubParsersAction) -> None:
    from cadence.lab.options import BENCH, add_flags

    p = sub.add_parser(
        "bench", help="measure a running server: TTFT, ITL, tails, segments", epilog=EXIT_CODES
    )
    add_flags(p, BENCH)  # as cadence.lab.options declares them
    p.set_defaults(func=_bench)


def check_scrapes(urls: list[str], command: str) -> None:
    """Read each `--scrape` page once; exits with one line when one cannot be read, before
    any load goes out."""
    from cadence.lab.measure.prometheus import ScrapeError, check_scrape_url

    for url in urls:
        try:
            check_scrape_url(url)
        except ScrapeError as exc:
            sys.exit(f"cadence {command}: --scrape {url}: {exc}")


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
    if args.protocol != "grpc":
        from cadence.lab.options import GRPC_ONLY

        given = [f"--{n.replace('_', '-')}" for n in GRPC_ONLY if getattr(args, n)]
        if given:
            sys.exit(f"cadence {command}: {', '.join(given)} need --protocol grpc")
        return None, None
    if not args.method or args.request_json is None:
        sys.exit(
            f"cadence {command}: --protocol grpc needs --method PACKAGE.SERVICE/METHOD and "
            "--request-json JSON"
        )
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
    grpc = GrpcTarget(
        schema=schema,
        request_json=args.request_json,
        tokens_field=args.tokens_field,
        index_field=args.index_field,
        headers=headers,
    )
    check_request(grpc, workload_from_args(args).shape.request(0))
    return grpc


def workload_from_args(args: argparse.Namespace):
    """The Workload that the load's options describe (cadence.lab.options.WorkloadOptions)."""
    from cadence.lab.bench import Workload
    from cadence.lab.load.plan import Conversation, RequestShape

    requests, concurrency = args.requests, args.concurrency
    trace, described = _trace_of(args)
    conversation = None
    if args.sessions is not None:
        turns = args.turns or 3
        conversation = Conversation(args.sessions, turns, args.think_ms)
        requests, concurrency = (
            min(requests or args.sessions * turns, args.sessions * turns),
            args.sessions,
        )
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


def _class_mix(args: argparse.Namespace):
    """The ClassMix of `--mix` and `--class`; None without them. Exits when they do not fit."""
    if args.mix is None:
        if args.classes:
            sys.exit("cadence bench: --class needs --mix (the classes' shares)")
        return None
    if args.prompts or args.trace or args.sessions:
        sys.exit(
            "cadence bench: --mix makes the requests itself: not with --prompts, --trace "
            "or --sessions"
        )
    from cadence.lab.load.plan import ClassMix, RequestClass
    from cadence.lab.options import length

    defined = {name: (prompt, out, slo) for name, prompt, out, slo in args.classes}
    classes = []
    for name, _ in args.mix:
        if name not in defined:
            sys.exit(f"cadence bench: --mix names {name!r}, but no --class defines it")
        prompt, out, slo = defined[name]
        lengths = {}
        for key, text, default in (
            ("prompt", prompt, args.prompt_tokens),
            ("max", out, args.max_tokens),
        ):
            try:
                lengths[key] = length(text) if text else default
            except argparse.ArgumentTypeError as exc:
                sys.exit(f"cadence bench: --class {name}: {key}={text}: {exc}")
        classes.append(
            RequestClass(
                name=name,
                prompt_tokens=_bounds(lengths["prompt"]),
                max_tokens=_bounds(lengths["max"]),
                prompt_lengths=_distribution(lengths["prompt"]),
                output_lengths=_distribution(lengths["max"]),
                slo=slo,
            )
        )
    return ClassMix(classes=classes, shares=[share for _, share in args.mix])


def _saturation_window(args: argparse.Namespace, stages) -> float:
    """`--saturation-stop`'s window (0 without it); exits when the load does not rise."""
    window = getattr(args, "saturation_stop", None)
    if window is None:
        return 0.0
    if not stages:
        sys.exit(
            "cadence bench: --saturation-stop needs a rising load: --rate LO:HI --ramp S "
            "or --stages"
        )
    if not window > 0:
        sys.exit("cadence bench: --saturation-stop takes a window above 0 seconds")
    return window


def _client_mix(args: argparse.Namespace):
    """The populations of `--read-delay-ms MS@SHARE%`, `--cancel-ms`, `--deadline-ms`; None
    when every request behaves alike. Exits when the shares add up to more than all."""
    from cadence.lab.load.plan import ClientMix

    read_delay = args.read_delay_ms if args.read_delay_ms[1] < 1.0 else (0.0, 0.0)
    cancel, deadline = args.cancel_ms or (0.0, 0.0), args.deadline_ms or (0.0, 0.0)
    if not (read_delay[1] or cancel[1] or deadline[1]):
        return None
    if read_delay[1] + cancel[1] + deadline[1] > 1.0 + 1e-9:
        sys.exit(
            "cadence bench: the shares of --read-delay-ms, --cancel-ms and --deadline-ms "
            "add up to more than 100%"
        )
    return ClientMix(read_delay=read_delay, cancel=cancel, deadline=deadline)


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
    sent = numbered[: args.requests] if args.requests else numbered
    if args.duration is not None:
        sent = [(n, row) for n, row in sent if row.offset_s <= args.duration]
    pause, before = 0.0, None
    for (_, earlier), (n, later) in itertools.pairwise(sent):
        if later.offset_s - earlier.offset_s > pause:
            pause, before = later.offset_s - earlier.offset_s, n
    span = sent[-1][1].offset_s if sent else 0.0
    longest = f"; the longest pause: {pause:g} s, before row {before}" if before else ""
    if args.duration is None and span > REPLAY_LIMIT_S:
        print(
            f"cadence bench: --trace {args.trace}: the replay would take {span:g} s{longest}; "
            f"give --duration S to replay that long, or cut it with --trace-window, "
            f"--trace-speed or --requests",
            file=sys.stderr,
        )
        sys.exit(2)
    cut = len(numbered[: args.requests] if args.requests else numbered) - len(sent)
    print(
        f"cadence bench: replaying {len(sent)} requests of {args.trace} over {span:g} s"
        + (longest if pause >= 60 else "")
        + (f" (--duration {args.duration:g} leaves out {cut} later rows)" if cut else ""),
        file=sys.stderr,
    )


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
    counter = None
    shown: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if progress_wanted(args.no_progress):
        counter = RequestCounter()
        shown = BenchProgress(counter, workload.requests, workload.duration_s)
    runs = []
    try:
        for _ in range(args.repeat):
            with shown:
                runs.append(
                    run_bench(
                        args.target,
                        workload,
                        processes=args.procs,
                        channels=args.channels,
                        baseline=args.baseline,
                        credentials=credentials,
                        protocol=protocol,
                        counter=counter,
                        server_pid=args.server_pid,
                        slo=slo,
                        scrape=args.scrape,
                        traces=traces,
                        traces_wait_s=args.otlp_wait,
                    )
                )
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
