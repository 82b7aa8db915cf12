"""configs/local-cascade.yaml serves the adaptive cascade out of the box: its coordinator names the
shipped predictor, trained for the config's one Stage (bf16) before the fp32 target, so a request's
finite cascade_lambda is served instead of refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from client.cluster_config import link_coordinators, load_cluster_config
from coordinator.cascade import CascadeStages, load_stopper, parse_cascade_stages, request_stages

ROOT = Path(__file__).resolve().parents[2]


def coordinator_options() -> dict:
    specs = load_cluster_config(ROOT / "configs" / "local-cascade.yaml", cores=2)
    link_coordinators(specs)  # as the launcher does: the coordinator learns the stages' addresses
    return next(spec for spec in specs if spec.kind == "coordinator").options


def test_the_shipped_cascade_config_names_its_predictor_for_its_stages():
    options = coordinator_options()
    predictor = ROOT / options["cascade_predictor"]  # the launcher starts processes in the repository root
    assert predictor.is_file()
    stages = parse_cascade_stages(options["cascade_stages"])
    assert len(stages) == 1 and stages[0].spec.fill  # the bf16 stage drafts what the n-gram base does not give
    cascade = CascadeStages(stages, open_channel=lambda address: object(), stopper=load_stopper(predictor, stages))
    assert math.isinf(cascade.default_lambda)  # lossless unless a request asks
    assert cascade.request_lambda(4.0, request_stages("", stages)) == 4.0


def test_without_a_predictor_a_finite_lambda_is_refused():
    stages = parse_cascade_stages(coordinator_options()["cascade_stages"])
    with pytest.raises(ValueError, match="no adaptive predictor"):
        CascadeStages(stages, open_channel=lambda address: object()).request_lambda(4.0, stages)
