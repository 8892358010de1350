"""What a load speaks: one target type, a tagged union of the protocols' targets, and the
registry that finds each protocol's module by its name.

Each variant makes its own driver (`target.driver()`, lab/load/driver.py) and says what the
bench may look up of a server that speaks it (`ServerFacts`); its tag is the protocol's name
(`protocol_name`), as `--protocol` spells it. A new protocol is a module with its target,
added to PROTOCOLS: nothing else branches on which protocol a run speaks.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from cadence.lab.load.cadence_v1 import CadenceTarget
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.kserve import KServeTarget
from cadence.lab.load.openai_http import OpenAITarget
from cadence.lab.results import Workload

Target = CadenceTarget | KServeTarget | GrpcTarget | OpenAITarget


def _tag(target: Target | type[Target]) -> str:
    """The variant's msgspec tag, its protocol's name (msgspec types a tag str | int)."""
    tag = target.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{target!r}: a target's tag is its protocol's name, a string")
    return tag


PROTOCOLS: dict[str, type[Target]] = {
    _tag(cls): cls for cls in (CadenceTarget, KServeTarget, GrpcTarget, OpenAITarget)
}
"""Each protocol's target by its name (`--protocol`), cadence's own first."""


class ServerFacts(Protocol):
    """What every target says of the server it drives, for the bench's measurements."""

    CADENCE_SERVER: ClassVar[bool]
    """The server is cadence's: its metrics page, workers and processes can be looked up
    (else it is any server, found by the port it listens on)."""
    HTTP2_SETTINGS: ClassVar[bool]
    """It is a gRPC server whose first HTTP/2 SETTINGS frame the bench reads before the run."""
    SERVER_TIMING: ClassVar[bool]
    """The server times every hop of each request itself, so its stacks are not sampled."""

    def address(self, target: str) -> str:
        """HOST:PORT of the server `target` names."""

    def describe(self, workload: Workload) -> None:
        """Add what the result's workload record says of this protocol (its model, ...)."""


def protocol_name(target: Target) -> str:
    """`cadence`, `kserve`, `grpc` or `openai`: the variant's tag."""
    return _tag(target)
