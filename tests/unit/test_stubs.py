"""The committed gRPC stubs are exactly what the protos generate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "generate_stubs.py"
SRC = ROOT / "src"


def _load_script():
    spec = importlib.util.spec_from_file_location("generate_stubs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate_stubs = _load_script()
STUB_FILES = [
    (stub_set.out_subdir / name) for stub_set in generate_stubs.STUB_SETS for name in stub_set.stubs
]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extras")
    out = tmp_path_factory.mktemp("stubs")
    generate_stubs.generate(out)
    return out


@pytest.mark.parametrize("path", STUB_FILES, ids=str)
def test_committed_stub_matches_proto(generated: Path, path: Path):
    fresh = (generated / path).read_text()
    committed = (SRC / path).read_text()
    assert fresh == committed, f"src/{path} is stale; run `python scripts/generate_stubs.py`"


def test_stubs_import_from_package_path(generated: Path):
    grpc_stub = (generated / "cadence/proto/v1/inference_pb2_grpc.py").read_text()
    assert "from cadence.proto.v1 import inference_pb2" in grpc_stub
    assert "from cadence.v1 import" not in grpc_stub
    kserve = generated / "cadence/proto/kserve"
    assert "from cadence.proto.kserve import model_config_pb2" in (kserve / "grpc_service_pb2.py").read_text()
    assert "from inference import" not in (kserve / "grpc_service_pb2_grpc.py").read_text()


def test_kserve_stubs_use_a_private_pool(generated: Path):
    """tritonclient puts the same `inference.*` names in protobuf's default pool."""
    for name in ("grpc_service_pb2.py", "model_config_pb2.py"):
        text = (generated / "cadence/proto/kserve" / name).read_text()
        assert "_private_pool.POOL.AddSerializedFile(" in text
        assert "_descriptor_pool.Default()" not in text


def test_kserve_protocol_matches_tritonclient():
    """Every field cadence declares has the number and type of tritonclient's own compiled
    protocol, so Triton's clients decode cadence's messages. (Both load in one process
    because cadence's copy lives in a private descriptor pool.)"""
    triton_service = pytest.importorskip("tritonclient.grpc.service_pb2",
                                         reason="tritonclient is in the test extras")
    from cadence.proto.kserve import grpc_service_pb2, model_config_pb2

    checked = 0
    for ours in (grpc_service_pb2, model_config_pb2):
        for message in _all_messages(ours.DESCRIPTOR.message_types_by_name.values()):
            theirs = triton_service.DESCRIPTOR.pool.FindMessageTypeByName(message.full_name)
            for field in message.fields:
                twin = theirs.fields_by_name[field.name]
                assert (field.number, field.type) == (twin.number, twin.type), field.full_name
                checked += 1
    assert checked > 80
    services = grpc_service_pb2.DESCRIPTOR.services_by_name
    assert [m.name for m in services["GRPCInferenceService"].methods] == [
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
        "ModelInfer", "ModelStreamInfer", "ModelConfig", "ModelStatistics",
    ]
    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in services["GRPCInferenceService"].methods:
        twin = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (
            twin.input_type.full_name, twin.output_type.full_name)


def _all_messages(messages):
    for message in messages:
        if not message.GetOptions().map_entry:
            yield message
            yield from _all_messages(message.nested_types)


def test_messages_pickle_by_their_real_module() -> None:
    # multiprocessing and Ray pickle messages by class; the class's module must import.
    import pickle

    from cadence.proto.kserve import grpc_service_pb2 as kpb
    from cadence.proto.v1 import inference_pb2 as pb

    chunk = pb.GenerateChunk(request_id="r", index=3, token_ids=[1, 2], finish_reason=1)
    assert pickle.loads(pickle.dumps(chunk)) == chunk
    request = kpb.ModelInferRequest(model_name="cadence")
    assert pickle.loads(pickle.dumps(request)) == request
