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

import msgspec

from cadence import event_loop
from cadence.engines.app import App, app_reference, importing_app


def serve(
    app: App | type | str,
    *,
    devices: str | list[str] = "cpu:1",
    tp: int = 1,
    engine_threads: int = 1,
    app_in_front: bool = False,
    on_started: Callable[[int], None] | None = None,
    **options: object,
) -> None:
    """Serve `app` over gRPC until SIGINT or SIGTERM.

    `app` is the function (`def` or `async def`, yielding `str` or `list[int]` pieces) or
    its `module:function` name, or a batched model class (`step(prefill, decode)`, see
    docs/models.md; `max_batch` and the other engine options apply to it).
    `devices` is `cpu:N`, `cuda:I,J,...`, `auto` or a list of device names: one worker per
    device (with `tp` > 1, per group of `tp` devices: a model class's tensor-parallel ranks). `engine_threads` sizes each worker's executor for a
    sync function (default one per device). `options` are any other ServerConfig field
    (`port`, `host`, `max_concurrent`, ...). `on_started(port)` is called once serving;
    without it, the line `cadence serving on HOST:PORT` is printed.
    """
    from cadence.config import EngineConfig, ServerConfig, group_devices, parse_devices
    from cadence.lifecycle import StartupError
    from cadence.lifecycle.server import run_server

    if importing_app():
        raise RuntimeError(
            "cadence.serve() was called while a worker imported the app's module; call it "
            "under `if __name__ == \"__main__\":` so that workers can import the function"
        )
    launcher = None
    is_class = inspect.isclass(app)
    if is_class and app_in_front:
        raise TypeError("a model class runs in worker processes, one per device; "
                        "app_in_front=True is for generator functions")
    if app_in_front and not isinstance(app, str):
        from cadence.lifecycle.in_front_launcher import InFrontLauncher

        launcher = InFrontLauncher(app)
        reference = f"{getattr(app, '__module__', '?')}:{getattr(app, '__qualname__', repr(app))}"
    else:
        reference = app_reference(app)
    engine_fields = set(EngineConfig.__struct_fields__)
    engine = {k: options.pop(k) for k in list(options) if k in engine_fields}
    if is_class:
        engine.update(name="model", model_class=reference)
    else:
        engine.update(name="app", app=reference, engine_threads=engine_threads)
    unknown = set(options) - set(ServerConfig.__struct_fields__)
    if unknown:
        raise TypeError(f"cadence.serve() got unknown options {sorted(unknown)}")
    # convert, not the constructor: it checks every option's type.
    config = msgspec.convert(
        {**options, "devices": group_devices(
            parse_devices(devices) if isinstance(devices, str) else list(devices), tp),
         "engine": engine, "app_in_front": app_in_front},
        ServerConfig,
    )

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
