"""Generate the Python code of the ``speculation.v1`` protos.

The protos import each other as ``speculation/v1/...`` with ``protos/`` as
the include root, the way any other project compiles them
(``protoc -I protos ...``): their descriptors are named
``speculation/v1/*.proto`` whoever compiles them. protoc then writes Python
that imports ``speculation.v1``; this project keeps its generated code in
the ``protos.speculation.v1`` package, so the import lines are rewritten to
that package after generation (nothing else in the files changes).

``python -m protos.generate`` rewrites the ``*_pb2*.py`` / ``*.pyi`` files next
to the ``.proto`` sources; ``generate(out_dir)`` writes them elsewhere so a
test can compare a fresh generation with the committed files.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
INCLUDE_ROOT = REPO_ROOT / "protos"
PROTO_DIR = INCLUDE_ROOT / "speculation" / "v1"
PACKAGE = "protos.speculation.v1"  # where this project's generated code lives

# `from speculation.v1 import worker_pb2 as ...` -> `from protos.speculation.v1 import ...`
_IMPORT = re.compile(r"^from speculation\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def run_protoc(out_dir: Path, grpc: bool = True) -> None:
    """protoc over every proto with ``protos/`` as the include root (the
    generated tree under ``out_dir`` is ``speculation/v1/``)."""
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{INCLUDE_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *([f"--grpc_python_out={out_dir}"] if grpc else []),
        *(str(p.relative_to(INCLUDE_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def generate(out_dir: Path) -> list[Path]:
    """Generate into ``out_dir/protos/speculation/v1``; return the files written."""
    target = out_dir / "protos" / "speculation" / "v1"
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_protoc(Path(tmp))
        written = []
        for path in sorted((Path(tmp) / "speculation" / "v1").iterdir()):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")):
                continue
            text = _IMPORT.sub(f"from {PACKAGE} import ", path.read_text())
            dest = target / path.name
            dest.write_text(text)
            written.append(dest)
    return written


def main() -> int:
    written = generate(REPO_ROOT)
    for path in written:
        print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
