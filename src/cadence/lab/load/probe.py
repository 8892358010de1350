"""Before a run: does the server speak the protocol the load is about to speak?

One request (one token) goes through the protocol's own driver. A server that answers it
UNIMPLEMENTED has no such method, so every request of the run would fail the same way: the
bench says so in one line instead of reporting a table of failures. Any other answer, an
error included, lets the run go on and record it.
"""

from __future__ import annotations

from cadence import event_loop
from cadence.credentials import ClientCredentials
from cadence.lab.load.driver import Session
from cadence.lab.load.plan import RequestPlan
from cadence.lab.load.target import PROTOCOLS, Target, protocol_name
from cadence.lab.records import RequestRecord

_TIMEOUT_S = 10.0


def require_protocol(
    protocol: Target, address: str, credentials: ClientCredentials | None = None
) -> None:
    """Raise RuntimeError (one line) when `address` answers one request UNIMPLEMENTED."""
    record = event_loop.run(_one(protocol, address, credentials))
    if record.code != "UNIMPLEMENTED":
        return
    name = protocol_name(protocol)
    others = ", ".join(p for p in PROTOCOLS if p != name)
    error = record.error.splitlines()[0] if record.error else "no message"
    raise RuntimeError(
        f"{address} does not speak --protocol {name}: it answers UNIMPLEMENTED "
        f"({error}); is it another service? use --protocol {others}"
    )


async def _one(
    protocol: Target, address: str, credentials: ClientCredentials | None
) -> RequestRecord:
    driver = protocol.driver()
    await driver.connect(
        Session(
            address=address, credentials=credentials, include_timing=False, timeout_s=_TIMEOUT_S
        )
    )
    try:
        record, _ = await driver.one(RequestPlan("probe", [1, 2, 3], 1), 0, 0)
    finally:
        await driver.close()
    return record
