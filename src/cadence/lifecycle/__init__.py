"""Composition, start and stop: the server's parts built in order and stopped in reverse
(`server.py`), its gRPC server (`grpc_server.py`, `call_acceptor.py`, `failed_sends.py`),
worker supervision (`supervisor.py`), how workers are launched (`launcher.py`,
`ray_launcher.py`, `in_front.py`) and, with `--fronts N`, the other front processes
(`fronts.py`, `front_child.py`). Nothing here is on a token's path."""


class StartupError(RuntimeError):
    """The server could not start; the message says why and what to do."""


class ServingFailed(RuntimeError):
    """A part the server cannot serve without (Envoy, with `--grpc-server native`) died while
    it served; the message says what. `cadence serve` exits non-zero, so that whatever runs
    it restarts it."""
