"""The client's GenerateRequest builder: skeleton layout names map to BranchLayout, unknown ones fail."""

import pytest

from client.cli_common import sampling_kwargs, sampling_parser
from client.coordinator_client import generate_request
from specmesh.proto.v1 import common_pb2


def test_sot_layout_flag_reaches_the_request():
    args = sampling_parser().parse_args(["--mode", "skeleton", "--sot-layout", "batching"])
    kwargs = {k: v for k, v in sampling_kwargs(args).items() if k != "timeout_s"}
    assert generate_request("q", **kwargs).skeleton_layout == common_pb2.BRANCH_LAYOUT_BATCHING
    assert generate_request("q", sot_layout="one_sequence").skeleton_layout == common_pb2.BRANCH_LAYOUT_ONE_SEQUENCE
    assert generate_request("q").skeleton_layout == common_pb2.BRANCH_LAYOUT_UNSPECIFIED  # the coordinator's
    with pytest.raises(ValueError, match="skeleton layout"):
        generate_request("q", sot_layout="diagonal")
