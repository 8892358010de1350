"""The bytes between the front and its workers (ZeroMQ, msgpack): `messages.py` (every message
that crosses a process boundary), `sockets.py` (addresses, queue bounds), `front_channel.py`
(the front's side: one `WorkerLink` per worker to send on, the `FrontChannel` that reads every
worker's output), `worker_channel.py` (a worker's side), `worker_to_fronts.py` (a worker's side
with `--fronts N`: its output split by owning front), `heartbeat.py`."""
