"""Generate the Python code of the ``speculation.v1`` protos.

``python -m protos.generate`` rewrites the ``*_pb2*.py`` / ``*.pyi`` files next
to the ``.proto`` sources; ``generate(out_dir)`` writes them elsewhere so a
test can compare a fresh generation with the committed files.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos" / "speculation" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) on every proto; return the files written."""
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(REPO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    generated_dir = out_dir / "protos" / "speculation" / "v1"
    return sorted(p for p in generated_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")))


def main() -> int:
    written = generate(REPO_ROOT)
    for path in written:
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
