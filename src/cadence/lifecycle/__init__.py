"""Composition, start and stop: the server's parts built in order and stopped in reverse
(`server.py`), worker supervision (`supervisor.py`), how workers are launched (`launcher.py`,
`ray_launcher.py`, `in_front_launcher.py`), with `--fronts N` the other front processes
(`front_children.py`, `front_child.py`, `front_layout.py`), and with `--grpc-server native` the
Envoy process that hosts the front (`envoy_front.py`). The network servers these start are
`cadence.net`; nothing here is on a token's path."""


class StartupError(RuntimeError):
    """The server could not start; the message says why and what to do."""


class ServingFailed(RuntimeError):
    """A part the server cannot serve without (Envoy, with `--grpc-server native`) died while
    it served; the message says what. `cadence serve` exits non-zero, so that whatever runs
    it restarts it."""
