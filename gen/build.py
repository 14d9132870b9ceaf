"""Regenerate the protobuf and gRPC modules in this folder from proto/.

`make proto` runs it; a test runs it into a temporary folder and compares,
so stale generated code fails the suite. Two rewrites follow protoc:
imports become relative, so the modules live inside `modeld.gen`; and the
descriptors go into modeld's own pool instead of protobuf's default one,
because tritonclient registers the same `inference.*` names in the default
pool and a process that imports both (a test, a benchmark, a user's script)
would otherwise fail with "duplicate symbol".
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
GEN_DIR = Path(__file__).resolve().parent
PROTOS = ("inference.proto", "generation.proto", "node.proto")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    for proto in PROTOS:
        code = protoc.main([
            "protoc", f"-I{PROTO_DIR}", f"-I{include}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / proto),
        ])
        if code != 0:
            raise SystemExit(f"protoc failed on {proto}")
    written = sorted(out_dir.glob("*_pb2*.py*"))
    for path in written:
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", path.read_text(), flags=re.M)
        text = text.replace("_descriptor_pool.Default().AddSerializedFile(", "_modeld_pool.POOL.AddSerializedFile(")
        text = text.replace("from google.protobuf.internal import builder as _builder",
                            "from google.protobuf.internal import builder as _builder\nfrom . import _pool as _modeld_pool")
        path.write_text(text)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else GEN_DIR):
        print(f"wrote {path}")
