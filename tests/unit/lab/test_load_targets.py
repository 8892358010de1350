"""One target type for the four protocols: each variant travels to a load process in its
plan (msgpack, tagged by protocol) and makes its own driver behind one interface."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from cadence.lab.load.cadence_v1 import CADENCE
from cadence.lab.load.driver import Driver
from cadence.lab.load.grpc_schema import from_protos
from cadence.lab.load.grpc_service import GrpcTarget
from cadence.lab.load.kserve import KServeTarget
from cadence.lab.load.openai_http import OpenAITarget
from cadence.lab.load.plan import RequestShape
from cadence.lab.load.processes import ProcessPlan
from cadence.lab.load.target import PROTOCOLS, protocol_name
from cadence.lab.results import Workload

PROTO = str(Path(__file__).resolve().parents[3] / "proto")
TARGETS = {
    "cadence": CADENCE,
    "kserve": KServeTarget("m"),
    "grpc": GrpcTarget(
        schema=from_protos(
            ["cadence/v1/inference.proto"], [PROTO], "cadence.v1.Inference/Generate"
        ),
        request_json='{"max_tokens": "{max_tokens}"}',
    ),
    "openai": OpenAITarget("http://127.0.0.1:1", "m"),
}


@pytest.mark.parametrize("name", TARGETS)
def test_a_target_travels_in_the_plan_and_makes_its_driver(name: str) -> None:
    plan = ProcessPlan(
        process=0, target="127.0.0.1:1", shape=RequestShape(), requests=1, protocol=TARGETS[name]
    )
    there = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=ProcessPlan)
    assert there.protocol == TARGETS[name]
    assert protocol_name(there.protocol) == name
    assert isinstance(there.protocol.driver(), Driver)


def test_the_default_protocol_is_cadence() -> None:
    plan = ProcessPlan(process=0, target="x", shape=RequestShape(), requests=1)
    assert protocol_name(plan.protocol) == "cadence"


def test_the_registry_finds_each_protocol_by_name() -> None:
    assert list(PROTOCOLS) == ["cadence", "kserve", "grpc", "openai"]
    for name, target in TARGETS.items():
        assert type(target) is PROTOCOLS[name]


@pytest.mark.parametrize("name", list(TARGETS))
def test_each_target_says_what_the_bench_may_look_up_of_its_server(name: str) -> None:
    target = TARGETS[name]
    facts = (target.CADENCE_SERVER, target.HTTP2_SETTINGS, target.SERVER_TIMING)
    assert (
        facts
        == {
            "cadence": (True, True, True),
            "kserve": (True, True, False),
            "grpc": (False, True, False),
            "openai": (False, False, False),
        }[name]
    )
    record = Workload()
    target.describe(record)
    assert record.model == {"kserve": "m", "openai": "m"}.get(name)
    assert (record.openai is not msgspec.UNSET) == (name == "openai")
    assert (record.grpc is not msgspec.UNSET) == (name == "grpc")
    # The facts are the class's, not fields: a plan's target travels without them.
    assert b"HTTP2_SETTINGS" not in msgspec.msgpack.encode(target)
    assert target.address("127.0.0.1:1") == "127.0.0.1:1"


def test_no_module_outside_the_registry_branches_on_the_protocol() -> None:
    # The bench's stages ask the target (lab/load/target.py's ServerFacts), never its type.
    lab = Path(__file__).resolve().parents[3] / "src" / "cadence" / "lab"
    text = (lab / "bench.py").read_text()
    assert "isinstance(" not in text
    assert not any(f'"{name}"' in text for name in TARGETS)
