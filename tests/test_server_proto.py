"""The committed gRPC bindings must be what server/gen_proto.py makes from the .proto."""
import importlib.util
import os
import tempfile

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) is needed to regenerate the bindings")

from jaxoverlap.server import gen_proto  # noqa: E402


def _tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def test_regenerated_bindings_match_committed():
    with tempfile.TemporaryDirectory() as tmp:
        gen_proto.generate(tmp)
        for name in gen_proto.GENERATED:
            with open(os.path.join(gen_proto.SERVER_DIR, name)) as f:
                committed = f.read()
            with open(os.path.join(tmp, name)) as f:
                fresh = f.read()
            if _tools_version() == gen_proto.GRPC_TOOLS_VERSION:
                assert committed == fresh, f"{name} is stale: run python server/gen_proto.py"
            else:
                # Another grpcio-tools stamps other version numbers; the schema must still agree.
                if name == "jaxoverlap_pb2.py":
                    assert _descriptor(committed) == _descriptor(fresh), f"{name} is stale"


def _descriptor(source: str) -> bytes:
    """The serialized FileDescriptorProto embedded in a _pb2 module's source."""
    start = source.index("AddSerializedFile(") + len("AddSerializedFile(")
    return eval(source[start: source.index(")\n", start)])  # noqa: S307 - our own generated literal


def test_bindings_import_inside_the_package():
    from jaxoverlap.server import jaxoverlap_pb2, jaxoverlap_pb2_grpc

    assert jaxoverlap_pb2.DESCRIPTOR.name == "jaxoverlap/v1/jaxoverlap.proto"
    assert jaxoverlap_pb2.DESCRIPTOR.package == "jaxoverlap.v1"
    service = jaxoverlap_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert set(service.methods_by_name) == {"Generate", "Abort", "GetModelInfo", "GetServerInfo"}
    assert hasattr(jaxoverlap_pb2_grpc, "GenerationStub")
    # The proto ships as package data next to the bindings.
    spec = importlib.util.find_spec("jaxoverlap.server")
    root = list(spec.submodule_search_locations)[0]
    assert os.path.exists(os.path.join(root, "proto", "jaxoverlap", "v1", "jaxoverlap.proto"))


def test_check_mode_reports_current():
    assert gen_proto.main(["--check"]) == (0 if _tools_version() == gen_proto.GRPC_TOOLS_VERSION else 1)
