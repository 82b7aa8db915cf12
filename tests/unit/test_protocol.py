"""Protocol conventions: Request/Response per RPC, *_UNSPECIFIED enum zeros, one package."""

import importlib

import pytest

MODULES = ["common", "draft", "verify", "stage", "coordinator"]


def _descriptors():
    for name in MODULES:
        yield importlib.import_module(f"specmesh.proto.v1.{name}_pb2").DESCRIPTOR


@pytest.mark.parametrize("file_descriptor", list(_descriptors()), ids=MODULES)
def test_package_and_enums(file_descriptor):
    assert file_descriptor.package == "specmesh.v1"
    for enum in file_descriptor.enum_types_by_name.values():
        zero = enum.values_by_number[0].name
        assert zero.endswith("_UNSPECIFIED"), zero


def test_every_rpc_has_its_own_request_and_response():
    seen = set()
    services = [s for fd in _descriptors() for s in fd.services_by_name.values()]
    assert {s.name for s in services} == {"DraftService", "VerifyService", "StageService", "CoordinatorService"}
    for service in services:
        for method in service.methods:
            for message in (method.input_type, method.output_type):
                assert message.name.endswith(("Request", "Response")), f"{service.name}.{method.name}: {message.name}"
                assert message.full_name not in seen, f"{message.name} is shared by two RPCs"
                seen.add(message.full_name)


def test_coordinator_generate_streams_and_has_modes():
    from specmesh.proto.v1 import coordinator_pb2

    method = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].methods_by_name["Generate"]
    assert method.server_streaming
    modes = set(coordinator_pb2.GenerationMode.keys())
    assert {"GENERATION_MODE_SPECULATIVE", "GENERATION_MODE_FUSED", "GENERATION_MODE_SKELETON",
            "GENERATION_MODE_AUTOREGRESSIVE"} <= modes
