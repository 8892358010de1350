"""Generate the Python gRPC stubs for proto/cadence/v1/inference.proto.

The stubs are committed so a fresh clone works without grpcio-tools;
tests/unit/test_stubs.py regenerates them and fails when they drift from the proto.

    python scripts/generate_stubs.py [OUT_DIR]   # default: src/cadence/api/v1
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = "cadence/v1/inference.proto"
STUBS = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc into a temporary tree, then place the stubs flat in `out_dir`.

    protoc names the import after the proto path (`cadence.v1`); the stubs live in
    `cadence.api.v1`, so the one import line is rewritten.
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
            str(PROTO_ROOT / PROTO),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in STUBS:
            text = (Path(tmp) / "cadence" / "v1" / name).read_text()
            text = text.replace("from cadence.v1 import", "from cadence.api.v1 import")
            (out_dir / name).write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "src" / "cadence" / "api" / "v1")
