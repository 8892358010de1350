"""`cadence.serve(generate, ...)` / `cadence.serve(MyModel, ...)`: serve a generator function
or a batched model class from Python.

The same server as `cadence serve --app MODULE:FUNCTION` (a function) or `cadence serve
--engine MODULE:CLASS` (a class: docs/models.md), started from a program: it blocks until
SIGINT or SIGTERM, then drains and stops. Worker processes import the function or class by
name, so it must be defined at the top level of a module (or of the script that calls
`serve` under `if __name__ == "__main__":`); with `app_in_front=True` any callable function
works, because it runs in this process.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from cadence import event_loop
from cadence.engines.app import App, app_reference, importing_app


def serve(
    app: App | type | str, *, on_started: Callable[[int], None] | None = None, **options: object
) -> None:
    """Serve `app` over gRPC until SIGINT or SIGTERM.

    `app` is the function (`def` or `async def`, yielding `str` or `list[int]` pieces) or
    its `module:function` name, or a batched model class (`step(prefill, decode)`, see
    docs/models.md; `max_batch` and the other engine options apply to it).
    `options` are `cadence serve`'s, named as ServerConfig's and EngineConfig's fields
    (cadence.config.serve_options), with the same defaults: `devices` is `cpu:N`,
    `cuda:I,J,...`, `auto` or a list of device names, one worker per device (with `tp` > 1,
    per group of `tp` devices: a model class's tensor-parallel ranks); `engine_threads` sizes
    each worker's executor for a sync function (default one per device); `port`, `host`,
    `max_concurrent`, `stall_timeout_s`, `drain_timeout_s`, ... An option that is not one is a
    TypeError naming it and the options it may have meant. `on_started(port)` is called once
    serving; without it, the line `cadence serving on HOST:PORT` is printed.
    """
    from cadence.lifecycle import StartupError
    from cadence.lifecycle.server import run_server

    if importing_app():
        raise RuntimeError(
            "cadence.serve() was called while a worker imported the app's module; call it "
            'under `if __name__ == "__main__":` so that workers can import the function'
        )
    config, launcher = configure(app, options)

    def started(server, port: int) -> None:
        if on_started is not None:
            on_started(port)
        else:
            print(f"cadence serving on {config.host}:{port}", flush=True)

    coro = run_server(config, on_started=started, launcher=launcher)
    try:
        event_loop.run(coro)
    except StartupError as exc:
        raise RuntimeError(f"cadence.serve: {exc}") from None


def configure(app: App | type | str, options: dict[str, object]):
    """`serve`'s ServerConfig for `app` and `options`, and the launcher of an app that runs in
    the front (else None). Raises TypeError for what is not an option, ValueError for a value
    that is wrong."""
    from cadence.config import server_config, unknown_options

    wrong = unknown_options(options)
    if wrong is not None:
        raise TypeError(f"cadence.serve(): {wrong}")
    launcher = None
    is_class = inspect.isclass(app)
    app_in_front = options.get("app_in_front", False)
    if is_class and app_in_front:
        raise TypeError(
            "a model class runs in worker processes, one per device; "
            "app_in_front=True is for generator functions"
        )
    if app_in_front and not isinstance(app, str):
        from cadence.lifecycle.in_front_launcher import InFrontLauncher

        launcher = InFrontLauncher(app)
        reference = f"{getattr(app, '__module__', '?')}:{getattr(app, '__qualname__', repr(app))}"
    else:
        reference = app_reference(app)
    engine = (
        {"name": "model", "model_class": reference}
        if is_class
        else {"name": "app", "app": reference}
    )
    return server_config({**options, **engine}), launcher
