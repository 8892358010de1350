"""The committed gRPC stubs are exactly what the proto generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "generate_stubs.py"
COMMITTED = ROOT / "src" / "cadence" / "api" / "v1"


def _load_script():
    spec = importlib.util.spec_from_file_location("generate_stubs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate_stubs = _load_script()


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extras")
    out = tmp_path_factory.mktemp("stubs")
    generate_stubs.generate(out)
    return out


@pytest.mark.parametrize("name", generate_stubs.STUBS)
def test_committed_stub_matches_proto(generated: Path, name: str):
    fresh = (generated / name).read_text()
    committed = (COMMITTED / name).read_text()
    assert fresh == committed, (
        f"src/cadence/api/v1/{name} is stale; run `python scripts/generate_stubs.py`"
    )


def test_stubs_import_from_package_path(generated: Path):
    grpc_stub = (generated / "inference_pb2_grpc.py").read_text()
    assert "from cadence.api.v1 import inference_pb2" in grpc_stub
    assert "from cadence.v1 import" not in grpc_stub
