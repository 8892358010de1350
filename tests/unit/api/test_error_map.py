"""One error vocabulary: docs/architecture.md's table of failures is cadence.api.errors' map."""

from __future__ import annotations

import json
from pathlib import Path

from cadence.api.errors import GRPC_STATUS, HTTP_STATUS, kserve_error_message
from cadence.api.kserve.service import _error
from cadence.api.openai.protocol import failure_body
from cadence.core.errors import RequestError
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.vocabulary import Failure

DOC = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"


def _table() -> dict[str, tuple[str, str, str]]:
    """failure -> (gRPC status, KServe column, OpenAI HTTP column) from the table under
    `## Error mapping`."""
    section = DOC.read_text().split("## Error mapping", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| failure", "|---")):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = (cells[1], cells[2], cells[3])
    return rows


def test_the_documented_table_is_the_map() -> None:
    table = _table()
    assert set(table) == {failure.name for failure in Failure}, "a failure is missing"
    assert {name: row[0] for name, row in table.items()} == {
        failure.name: code.name for failure, code in GRPC_STATUS.items()
    }


def test_every_failure_has_an_in_band_kserve_error_that_names_its_status() -> None:
    table = _table()
    for failure in Failure:
        assert kserve_error_message(failure, "why") == f"{GRPC_STATUS[failure].name}: why"
        response = kpb.ModelStreamInferResponse.FromString(
            _error("r1", RequestError(failure, "why"))
        )
        assert response.error_message == f"{GRPC_STATUS[failure].name}: why"
        assert response.infer_response.id == "r1"
        if failure is not Failure.CANCELLED:  # a cancelled call has no one to tell
            assert table[failure.name][1] == f"in-band `{GRPC_STATUS[failure].name}: ...`"


def test_every_failure_has_an_openai_status_and_error_body() -> None:
    table = _table()
    for failure in Failure:
        status, body = failure_body(failure, "why", "max_tokens")
        assert status == HTTP_STATUS[failure][0]
        assert table[failure.name][2].split()[0] == str(status)
        assert json.loads(body) == {
            "error": {
                "message": "why",
                "type": HTTP_STATUS[failure][1],
                "param": "max_tokens",
                "code": failure.name.lower(),
            }
        }
