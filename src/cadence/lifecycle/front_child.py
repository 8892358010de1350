"""`--fronts N`: fronts 1..N-1, each a child process of front 0 (`cadence serve` itself).

Started as `python -m cadence.lifecycle.front_child K BASE_DIR CONFIG_JSON LOG_LEVEL
GENERATION` (see `front_children.FrontChildren`). A child front serves the same port (SO_REUSEPORT)
with the same code as front 0 (`CadenceServer` with `front=K`), binds its own sockets in front
0's private folder, and is connected to by every worker. It launches no workers:
`supervisor.WorkerWatcher` follows the ones front 0 launched (they report ready to every front)
and fails this front's streams on a worker that stopped. Like a worker, it has its own session
(Ctrl-C reaches front 0 only, which stops it in order) and dies with front 0 (PDEATHSIG).
`GENERATION` counts front 0's restarts of front K, so a restarted front's sequence ids never
repeat its predecessor's.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys

import msgspec

from cadence import event_loop
from cadence.config import ServerConfig
from cadence.lifecycle.server import CadenceServer, run_until_signalled
from cadence.worker import bind_to_starter, starter_gone


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parent = bind_to_starter()
    if parent is None:  # front 0 died before it could take this front with it
        return
    try:
        _serve(argv)
    finally:
        if starter_gone(parent):
            # Front 0 was killed: nothing else would remove the folder it shares with the
            # fronts (their sockets, ready files, the admission count).
            shutil.rmtree(argv[1], ignore_errors=True)


def _serve(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    front, base = int(argv[0]), argv[1]
    config = msgspec.json.decode(argv[2].encode(), type=ServerConfig)
    level = int(argv[3]) if len(argv) > 3 else logging.WARNING
    generation = int(argv[4]) if len(argv) > 4 else 0
    logging.basicConfig(level=level, format=f"%(asctime)s front-{front} %(name)s %(message)s")
    if config.grpc_server == "native":  # this process starts Envoy, which runs the front
        from cadence.lifecycle import ServingFailed, StartupError, envoy_front

        try:
            event_loop.run(
                envoy_front.run_in_envoy(
                    config, log_level=logging.getLevelName(level), child=(front, base, generation)
                )
            )
        except (StartupError, ServingFailed) as exc:
            sys.exit(f"front {front}: {exc}")
        return
    server = CadenceServer(config, front=front, base_dir=base, generation=generation)
    event_loop.run(run_until_signalled(server))


if __name__ == "__main__":
    main()
