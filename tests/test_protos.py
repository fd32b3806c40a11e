"""The committed generated code matches a fresh protoc run of the .proto files."""

from pathlib import Path

from protos.generate import PROTO_DIR, generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        committed = PROTO_DIR / path.name
        assert committed.exists(), f"{committed.name} is missing: run `make proto`"
        assert committed.read_text() == path.read_text(), f"{committed.name} is stale: run `make proto`"
    committed_names = {p.name for p in PROTO_DIR.glob("*_pb2*.py*")}
    assert committed_names == {p.name for p in fresh}, "generated files without a .proto: run `make proto`"


def test_enums_start_unspecified_and_package_is_versioned() -> None:
    from protos.speculation.v1 import plan_pb2, worker_pb2

    for module in (plan_pb2, worker_pb2):
        assert module.DESCRIPTOR.package == "speculation.v1"
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.name
