"""Generate the Python gRPC stubs for cadence's protos.

- proto/cadence/v1/inference.proto → src/cadence/proto/v1 (cadence's own API)
- proto/inference/{model_config,grpc_service}.proto → src/cadence/proto/kserve (the Open
  Inference Protocol, KServe v2 / Triton)

The stubs are committed so a fresh clone works without grpcio-tools;
tests/unit/proto/test_stubs.py regenerates them and fails when they drift from the protos.

    python scripts/generate_stubs.py [SRC_DIR]   # default: src
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


class StubSet(NamedTuple):
    """Protos of one proto package, and the Python package their stubs live in."""

    protos: tuple[str, ...]
    """Paths under proto/."""
    proto_package: str
    """The import path protoc writes (`cadence.v1`), rewritten to `python_package`."""
    python_package: str
    stubs: tuple[str, ...]
    """The generated files to keep (protoc also writes empty `_grpc` files for protos
    without services)."""
    private_pool: str | None = None
    """A module whose `POOL` the descriptors go into instead of protobuf's default pool."""

    @property
    def out_subdir(self) -> Path:
        return Path(*self.python_package.split("."))


STUB_SETS = (
    StubSet(
        protos=("cadence/v1/inference.proto",),
        proto_package="cadence.v1",
        python_package="cadence.proto.v1",
        stubs=("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"),
    ),
    StubSet(
        protos=("inference/model_config.proto", "inference/grpc_service.proto"),
        proto_package="inference",
        python_package="cadence.proto.kserve",
        stubs=(
            "model_config_pb2.py",
            "model_config_pb2.pyi",
            "grpc_service_pb2.py",
            "grpc_service_pb2.pyi",
            "grpc_service_pb2_grpc.py",
        ),
        # tritonclient registers the same `inference.*` names in the default pool; two
        # definitions of one name cannot share a pool, and both must work in one process.
        private_pool="cadence.proto.kserve.pool",
    ),
)


def generate(src_dir: Path) -> None:
    """Write every stub set's stubs under `src_dir` (as `src_dir/cadence/proto/v1/...`)."""
    for stub_set in STUB_SETS:
        generate_set(stub_set, src_dir / stub_set.out_subdir)


def generate_set(stub_set: StubSet, out_dir: Path) -> None:
    """Run protoc into a temporary tree, then place the stubs flat in `out_dir`.

    protoc names imports and the messages' module after the proto path (`cadence.v1`,
    `inference`); the stubs live in `python_package`, so both are rewritten. With a `private_pool`, the
    descriptors are added to that module's `POOL` instead of the default pool.
    """
    import tempfile

    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_ROOT / proto) for proto in stub_set.protos),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        generated = Path(tmp, *stub_set.proto_package.split("."))
        for name in stub_set.stubs:
            text = (generated / name).read_text()
            text = text.replace(
                f"from {stub_set.proto_package} import", f"from {stub_set.python_package} import"
            )
            # The messages' __module__ too, or pickle (multiprocessing, Ray) cannot find their
            # classes: it would import `cadence.v1.inference_pb2`, which does not exist.
            text = text.replace(
                f"BuildTopDescriptorsAndMessages(DESCRIPTOR, '{stub_set.proto_package}.",
                f"BuildTopDescriptorsAndMessages(DESCRIPTOR, '{stub_set.python_package}.",
            )
            if stub_set.private_pool and name.endswith("_pb2.py"):
                text = _use_private_pool(text, stub_set.private_pool)
            (out_dir / name).write_text(text)


_POOL_IMPORT = "from google.protobuf import descriptor_pool as _descriptor_pool\n"


def _use_private_pool(text: str, module: str) -> str:
    """Point a `_pb2.py` file's `AddSerializedFile` at `module.POOL`."""
    package, _, name = module.rpartition(".")
    if _POOL_IMPORT not in text or "_descriptor_pool.Default()" not in text:
        raise SystemExit("protoc's output changed: cannot redirect it to a private pool")
    text = text.replace(
        _POOL_IMPORT, f"{_POOL_IMPORT}from {package} import {name} as _private_pool\n"
    )
    return text.replace("_descriptor_pool.Default()", "_private_pool.POOL")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "src")
