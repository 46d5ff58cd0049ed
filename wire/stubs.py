"""Generating the protobuf stubs (fedsilo_pb2.py and its .pyi) from fedsilo.proto with
grpcio-tools.

`python -m fedsilo.wire.stubs` writes them next to the .proto; `generate(folder)` writes them
elsewhere so a test can check that the committed stubs match the .proto. No gRPC service stub
is generated: frames cross gRPC as bytes (wire/framing.py `exchange_call`, and the servers'
handlers), so the service needs none.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

PROTO = Path(__file__).with_name("fedsilo.proto")
STUBS = ("fedsilo_pb2.py", "fedsilo_pb2.pyi")


def generate(out: Path) -> list[Path]:
    """Compile the .proto as `fedsilo/wire/fedsilo.proto`, so imports are package-absolute."""
    from grpc_tools import protoc  # a development dependency, needed only here

    with tempfile.TemporaryDirectory() as root:
        source = Path(root) / "fedsilo" / "wire"
        source.mkdir(parents=True)
        shutil.copy(PROTO, source / PROTO.name)
        args = [
            "protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            str(source / PROTO.name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        out.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(source / name, out / name)) for name in STUBS]


if __name__ == "__main__":
    for path in generate(PROTO.parent):
        print(f"wrote {path}")
