"""What a load speaks: one target type, a tagged union of the four protocols' targets.

Each variant makes its own driver (`target.driver()`, lab/load/driver.py), and its tag is
the protocol's name (`protocol_name`), as `--protocol` spells it.
"""

from __future__ import annotations

from cadence.lab.load.cadence_v1 import CadenceTarget
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.kserve import KServeTarget
from cadence.lab.load.openai_http import OpenAITarget

Target = CadenceTarget | KServeTarget | GrpcTarget | OpenAITarget


def protocol_name(target: Target) -> str:
    """`cadence`, `kserve`, `grpc` or `openai`: the variant's tag."""
    return target.__struct_config__.tag
