"""Stream model output over gRPC from machines with several accelerator cards, and measure
where the latency goes."""

from __future__ import annotations

import argparse
import logging
import sys

from cadence import event_loop
from cadence.core.tracing import endpoint_from_env


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, unless the help already says what it is; an
    unset default reads "none", a switch's "off"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.required:
            return action.help
        if action.option_strings and action.default is False:
            return f"{action.help} (default: off)"
        if action.option_strings and action.default in (None, "", []):
            return f"{action.help} (default: none)"
        return super()._get_help_string(action)


class _CommandParser(argparse.ArgumentParser):
    """A command's parser: its flags' defaults in its help, and a mistyped flag reported
    with this command's usage (argparse leaves it to the top level, which shows its own)."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsShown)
        super().__init__(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed, unknown


def _step_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MS,MS,... (numbers), got {text!r}") from None


_ENGINES = ("synthetic", "app", "torch", "transformers")


def _engine_choice(text: str) -> str:
    if text in _ENGINES or ":" in text:
        return text
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {', '.join(_ENGINES)}, or MODULE:CLASS for "
        "your batched model class)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from cadence.config import EngineConfig, ServerConfig

    d, e = ServerConfig(), EngineConfig()  # the defaults, from their one place
    p = sub.add_parser("serve", help="run a server: the gRPC front and one worker per device")
    p.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    p.add_argument("--port", type=int, default=d.port, help="port to bind; 0 picks a free one")
    devices = f"cpu:{len(d.devices)}"
    p.add_argument("--devices", default=devices,
                   help=f"cpu:N, cuda:I,J,... or auto (default {devices})")
    p.add_argument("--engine", default=e.name, type=_engine_choice,
                   metavar="{synthetic,app,torch,transformers,MODULE:CLASS}",
                   help="what generates the tokens: a synthetic model of an engine's timing, "
                        "your generator function (--app), a Llama model in torch (--model), "
                        "any causal LM that transformers loads (transformers --model PATH), or "
                        "your batched model class (docs/models.md)")
    p.add_argument("--app", default="", metavar="MODULE:FUNCTION",
                   help="serve your generator function (sync or async; implies --engine app)")
    p.add_argument("--engine-threads", type=int, default=e.engine_threads,
                   help="app engine, sync function: executor threads per worker (default "
                        f"{e.engine_threads}, one per device)")
    p.add_argument("--app-in-front", action="store_true",
                   help="run the app in the front process instead of worker processes")
    p.add_argument("--model", default="", metavar="PATH|tiny",
                   help="torch engine: a local Hugging Face Llama folder, or tiny (implies --engine "
                        "torch); --engine transformers: the folder transformers loads")
    p.add_argument("--tp", type=int, default=1,
                   help="torch engine or MODULE:CLASS: tensor-parallel ranks per worker; "
                        "--devices cpu:4 --tp 2 "
                        "gives two workers of two ranks")
    p.add_argument("--dtype", default=e.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="torch and transformers engines: compute dtype (auto: float32 on CPU, "
                        "the checkpoint's on CUDA)")
    p.add_argument("--kv-cache-tokens", type=int, default=e.kv_cache_tokens,
                   help=f"torch engine: KV cache capacity per worker, in tokens (default "
                        f"{e.kv_cache_tokens})")
    p.add_argument("--cuda-graph-batch", type=int, default=e.cuda_graph_batch,
                   help="torch engine on CUDA, --tp 1: decode steps of up to N sequences replay "
                        f"captured CUDA graphs (default {e.cuda_graph_batch}; 0 turns them off)")
    p.add_argument("--step-ms", type=float, default=e.step_ms, help="synthetic decode step (ms)")
    p.add_argument("--step-ms-by-worker", type=_step_list, default=e.step_ms_by_worker,
                   metavar="MS,MS,...",
                   help="synthetic: each worker's decode step, one per worker in --devices "
                        "order, to model cards of different speeds (overrides --step-ms)")
    p.add_argument("--per-seq-ms", type=float, default=e.per_seq_ms, help="synthetic cost per sequence in a step (ms)")
    p.add_argument("--prefill-ms-per-token", type=float, default=e.prefill_ms_per_token, help="synthetic prefill cost (ms/token)")
    p.add_argument("--jitter-ms", type=float, default=e.jitter_ms, help="synthetic step jitter, std dev (ms)")
    p.add_argument("--first-step-ms", type=float, default=e.first_step_ms, help="extra time on each worker's first step (ms)")
    p.add_argument("--seed", type=int, default=e.seed,
                   help="seed of the synthetic engine's tokens and jitter")
    p.add_argument("--max-batch", type=int, default=e.max_batch, help="sequences per engine step at most")
    p.add_argument("--max-step-tokens", type=int, default=e.max_step_tokens, metavar="N",
                   help="a step's token budget (decoded sequences + prompt tokens prefilled): "
                        "long prompts are prefilled in chunks beside the decodes, by engines "
                        "that take chunks (torch, synthetic; model classes that opt in) "
                        "(default: no budget, each prompt whole in one step)")
    p.add_argument("--itl-target-ms", type=float, default=e.itl_target_ms, metavar="MS",
                   help="a step's budget from the worker's own measured step-time model, so a "
                        "step stays within MS while long prompts are prefilled in chunks "
                        "(default: off; instead of --max-step-tokens)")
    p.add_argument("--batch-timeout-ms", type=float, default=e.batch_timeout_ms, metavar="MS",
                   help="MODULE:CLASS with generate_stream(batch): how long the first waiting "
                        "request waits for others to fill a batch before it starts (default "
                        f"{e.batch_timeout_ms:g})")
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent, help="streams admitted at once")
    p.add_argument("--queue-capacity", type=int, default=d.queue_capacity, help="steps of output a request's buffer holds")
    p.add_argument("--overflow", default=d.overflow, choices=["merge", "block", "abort"],
                   help="when a client lags past --queue-capacity: merge its tokens, pause its "
                        "sequence in the engine, or end its stream")
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s, metavar="S",
                   help="cut off a client that reads nothing for this many seconds: its stream "
                        "ends with an error (HTTP: an error event and [DONE], then the "
                        "connection closes) (default: never)")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="largest request message accepted")
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit,
                   help="largest max_tokens a request may ask for (INVALID_ARGUMENT above)")
    p.add_argument("--accept-ahead", type=int, default=d.accept_ahead, metavar="N",
                   help="new calls of each streaming method requested from gRPC ahead of their "
                        "arrival, so a burst of calls is taken in while other streams keep the "
                        "front busy (0: grpc.aio's own accept loop, one at a time)")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="longest prompt accepted, in tokens (INVALID_ARGUMENT above)")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="serve Prometheus metrics on this port (0: any free port), on --host, "
                        "over plain HTTP with no TLS and no token: anyone who can reach it "
                        "reads them (default: off)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export one OpenTelemetry span per request (every protocol) to this "
                        "OTLP/gRPC endpoint, e.g. http://127.0.0.1:4317; needs cadence[otel] "
                        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT when set, else off)")
    p.add_argument("--grpc-server", default=d.grpc_server, choices=["aio", "native"],
                   help="aio: grpc.aio (default); native: gRPC on Envoy's HTTP/2 through pyvoy "
                        "(the front runs inside Envoy, one Envoy per front; local workers only; "
                        "needs cadence[native]; see docs/native-grpc.md)")
    p.add_argument("--fronts", type=int, default=d.fronts,
                   help="front processes sharing the port, each connected to every worker "
                        "(default 1)")
    p.add_argument("--transport", default=None, choices=["ipc", "tcp"],
                   help="front <-> worker sockets (default ipc; tcp with --launcher ray)")
    p.add_argument("--worker-host", default=d.worker_host, metavar="ADDR",
                   help="tcp: the address the front binds for its workers (default 127.0.0.1; "
                        "the Ray node's IP with --launcher ray)")
    cluster = p.add_argument_group("placement on other hosts (see docs/ray.md)")
    cluster.add_argument("--launcher", default=d.launcher, choices=["local", "ray"],
                         help="start workers as child processes (local) or as Ray actors")
    cluster.add_argument("--ray-address", default=d.ray_address, metavar="ADDR",
                         help="Ray cluster to join (HOST:PORT or auto); default: a Ray "
                              "instance on this host")
    cluster.add_argument("--dist-ifname", default=d.dist_ifname, metavar="IFNAME",
                         help="network interface torch.distributed uses between hosts "
                              "(default: the one carrying each Ray node's IP)")
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s, metavar="S",
                   help=f"front <-> worker heartbeat period in seconds (default "
                        f"{d.heartbeat_interval_s:g})")
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s, metavar="S",
                   help="a worker silent this long is restarted; a worker that hears no front "
                        f"this long exits (default {d.heartbeat_timeout_s:g})")
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s,
                   help="seconds every worker gets to load its engine and report ready")
    p.add_argument("--worker-timeout", type=float, default=d.worker_timeout_s,
                   help="seconds without a step (while requests are open) before a worker counts "
                        "as hung and is restarted; 0 disables")
    p.add_argument("--no-restart", action="store_true", help="do not restart workers that die")
    p.add_argument("--drain-timeout", "--grace", dest="grace", type=float,
                   default=d.drain_timeout_s,
                   help="on SIGINT/SIGTERM, seconds open streams get to finish before they end "
                        "with UNAVAILABLE")
    security = p.add_argument_group("security (see docs/architecture.md#security)")
    security.add_argument("--tls-cert", default=None, metavar="PEM",
                          help="serve TLS only, with this certificate chain (needs --tls-key)")
    security.add_argument("--tls-key", default=None, metavar="PEM", help="the key of --tls-cert")
    security.add_argument("--tls-client-ca", default=None, metavar="PEM",
                          help="mutual TLS: require client certificates signed by this CA")
    security.add_argument("--auth-token-file", default=None, metavar="FILE",
                          help="require 'authorization: Bearer <token>' with a token from FILE "
                               "(one per line) on every RPC but health")
    p.add_argument("--kserve-model-name", default=d.kserve_model_name, metavar="NAME",
                   help="the model's name in the Open Inference Protocol (KServe v2 / Triton "
                        "gRPC, same port; docs/kserve.md)")
    p.add_argument("--served-model-name", default=d.served_model_name, metavar="NAME",
                   help="the model's name for every protocol: OpenAI's model (GET /v1/models) "
                        "and KServe's (default: --kserve-model-name's)")
    p.add_argument("--http-port", type=int, default=d.http_port, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health) on this port; 0 picks a "
                        "free one (default: off; docs/openai.md)")
    p.add_argument("--http-header-timeout", type=float, default=d.http_header_timeout_s,
                   metavar="S",
                   help="HTTP: seconds a client has to send a request's headers, and an idle "
                        "keep-alive connection stays open (default %(default)g)")
    p.add_argument("--http-body-timeout", type=float, default=d.http_body_timeout_s,
                   metavar="S",
                   help="HTTP: seconds a client has to send a request's body; then 408 "
                        "(default %(default)g)")
    p.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR: the least severe message logged")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> None:
    from cadence.lifecycle import ServingFailed, StartupError
    from cadence.lifecycle.server import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config = _server_config(args)
    except ValueError as exc:
        sys.exit(f"cadence serve: {exc}")

    def announce(server, port: int) -> None:
        # One machine-readable line, so scripts and tests can find the port; the HTTP port
        # comes before the metrics port, which tools read as the line's last part.
        http = f" (http on {args.host}:{server.http_port})" if server.http_port else ""
        metrics = f" (metrics on {args.host}:{server.metrics_port})" if server.metrics_port else ""
        print(f"cadence serving on {args.host}:{port}{http}{metrics}", flush=True)

    try:
        if config.grpc_server == "native":
            from cadence.lifecycle import envoy_front

            event_loop.run(envoy_front.run_in_envoy(config, on_started=announce,
                                                   log_level=args.log_level))
        else:
            event_loop.run(run_server(config, on_started=announce))
    except (StartupError, ServingFailed) as exc:
        sys.exit(f"cadence serve: {exc}")


def _server_config(args: argparse.Namespace):
    from cadence.config import (
        EngineConfig,
        ServerConfig,
        cpu_threads_per_rank,
        group_devices,
        parse_devices,
    )

    devices = group_devices(parse_devices(args.devices), args.tp)
    engine = "app" if args.app else args.engine
    model_class = ""
    if ":" in engine:  # --engine MODULE:CLASS
        engine, model_class = "model", engine
    if args.model and engine == "synthetic":
        engine = "torch"
    return ServerConfig(
        host=args.host,
        port=args.port,
        devices=devices,
        engine=EngineConfig(
            name=engine,
            step_ms=args.step_ms,
            per_seq_ms=args.per_seq_ms,
            prefill_ms_per_token=args.prefill_ms_per_token,
            jitter_ms=args.jitter_ms,
            first_step_ms=args.first_step_ms,
            step_ms_by_worker=args.step_ms_by_worker,
            seed=args.seed,
            max_batch=args.max_batch,
            max_step_tokens=args.max_step_tokens,
            itl_target_ms=args.itl_target_ms,
            batch_timeout_ms=args.batch_timeout_ms,
            app=args.app,
            model_class=model_class,
            engine_threads=args.engine_threads,
            model=args.model,
            dtype=args.dtype,
            kv_cache_tokens=args.kv_cache_tokens,
            cuda_graph_batch=args.cuda_graph_batch,
            threads=cpu_threads_per_rank(devices) if engine in ("torch", "transformers") else 0,
        ),
        max_concurrent=args.max_concurrent,
        queue_capacity=args.queue_capacity,
        overflow=args.overflow,
        stall_timeout_s=args.stall_timeout,
        max_message_bytes=args.max_message_bytes,
        accept_ahead=args.accept_ahead,
        max_tokens_limit=args.max_tokens_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        metrics_port=args.metrics_port,
        transport=args.transport or ("tcp" if args.launcher == "ray" else "ipc"),
        worker_host=args.worker_host,
        launcher=args.launcher,
        ray_address=args.ray_address,
        dist_ifname=args.dist_ifname,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        fronts=args.fronts,
        grpc_server=args.grpc_server,
        drain_timeout_s=args.grace,
        startup_timeout_s=args.startup_timeout,
        worker_timeout_s=args.worker_timeout or None,
        restart_workers=not args.no_restart,
        app_in_front=args.app_in_front,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        auth_token_file=args.auth_token_file,
        kserve_model_name=args.kserve_model_name,
        served_model_name=args.served_model_name,
        http_port=args.http_port,
        http_header_timeout_s=args.http_header_timeout,
        http_body_timeout_s=args.http_body_timeout,
        otlp_traces_endpoint=args.otlp_traces_endpoint or endpoint_from_env(),
    )


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream one request's text to the terminal")
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of a cadence server")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, sent with the request")
    from cadence.credentials import add_arguments

    add_arguments(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> None:
    import grpc

    from cadence.client import Client
    from cadence.credentials import from_arguments

    try:
        credentials = from_arguments(args)
    except ValueError as exc:
        sys.exit(f"cadence generate: {exc}")
    with Client(args.target, credentials=credentials) as client:
        try:
            for chunk in client.generate(
                args.prompt, max_tokens=args.max_tokens, timeout=args.timeout, seed=args.seed
            ):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except grpc.RpcError as exc:
            sys.stdout.write("\n")
            sys.exit(f"cadence generate: {exc.code().name}: {exc.details()}")
    sys.stdout.write("\n")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start a CPU server, stream a few requests, run a short bench")
    p.add_argument("--workers", type=int, default=2, help="CPU workers of the demo's server")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="the synthetic engine's decode step (ms)")
    p.add_argument("--streams", type=int, default=64, help="streams open at once in the bench")
    p.set_defaults(func=lambda a: __import__("cadence.lab.demo", fromlist=["run_demo"]).run_demo(
        a.workers, a.step_ms, a.streams))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cadence")
    except PackageNotFoundError:
        return "unknown (cadence is not installed; no package metadata)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadence", usage="%(prog)s [-h] [--version] COMMAND ...",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", prog="cadence",
                                parser_class=_CommandParser, help=argparse.SUPPRESS)
    _add_serve(sub)
    _add_generate(sub)
    _add_demo(sub)
    from cadence.lab.bench_cli import add_bench
    from cadence.lab.capacity_cli import add_capacity
    from cadence.lab.report_cli import add_report
    from cadence.lab.sweep_cli import add_sweep

    add_bench(sub)
    add_sweep(sub)
    add_capacity(sub)
    add_report(sub)
    # The commands listed once, in the description, rather than again as a positional.
    commands = "\n".join(f"  {a.dest:<10}{a.help}" for a in sub._choices_actions)
    parser.description = (f"{__doc__}\n\ncommands (cadence COMMAND -h for each one's flags):\n"
                          f"{commands}")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `cadence` command."""
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
