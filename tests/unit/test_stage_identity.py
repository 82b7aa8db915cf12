"""A cascade stage's fingerprint (specmesh.cascade.identity): what decides the numbers moves it, what a
converter stamps on the files does not (a shipped predictor must keep matching the model it was trained on)."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmesh.cascade.identity import fingerprint
from specmesh.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("smollm2", tmp_path_factory.mktemp("tiny") / "m")


def copy_of(model, tmp_path):
    return shutil.copytree(model, tmp_path / "copy")


def rewrite_config(folder, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(dict(reversed(list(config.items()))), indent=1))  # another key order too


def test_same_model_same_fingerprint_whoever_wrote_the_files(model, tmp_path):
    before = fingerprint(model)
    folder = copy_of(model, tmp_path)

    def as_an_older_converter(config):  # what transformers 4 wrote for the same model
        config["transformers_version"] = "4.56.0"
        config["torch_dtype"] = config.pop("dtype", "float32")
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
        config["_name_or_path"] = "/somewhere/else"

    rewrite_config(folder, as_an_older_converter)
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    save_file(dict(reversed(list(tensors.items()))), weights, metadata={"format": "pt", "writer": "another"})
    assert fingerprint(folder) == before


def test_weights_architecture_and_numerics_move_it(model, tmp_path):
    before = fingerprint(model)
    assert fingerprint(model, "bfloat16") != before and fingerprint(model, quantize="int8") != before
    folder = copy_of(model, tmp_path)
    rewrite_config(folder, lambda config: config.update(rms_norm_eps=1e-5 * 2))
    assert fingerprint(folder) != before
    shutil.copy(model / "config.json", folder / "config.json")
    assert fingerprint(folder) == before
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += torch.tensor(1e-3, dtype=tensors[name].dtype)
    save_file(tensors, weights)
    assert fingerprint(folder) != before


def test_a_safetensors_file_counts_by_its_tensors_not_its_header(tmp_path):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"x": torch.arange(4.0), "y": torch.ones(2, 2)}, first, metadata={"format": "pt"})
    save_file({"y": torch.ones(2, 2), "x": torch.arange(4.0)}, second)
    header = lambda path: path.read_bytes()[8:8 + struct.unpack("<Q", path.read_bytes()[:8])[0]]  # noqa: E731
    assert header(first) != header(second)  # the files differ ...
    folder_a, folder_b = tmp_path / "fa", tmp_path / "fb"
    for folder, file in ((folder_a, first), (folder_b, second)):
        folder.mkdir()
        shutil.copy(file, folder / "model.safetensors")
    assert fingerprint(folder_a) == fingerprint(folder_b)  # ... their tensors do not


@pytest.mark.slow
def test_the_shipped_predictors_match_the_default_model(default_model_dir):
    """specmesh/cascade/data's predictors name the default model's stages by fingerprint; converted here
    (whatever transformers wrote its config), the default model must still be those stages, or
    bench/cascade.py and `specmesh cascade` refuse the shipped predictors."""
    from pathlib import Path

    from specmesh.cascade.identity import parse_stage_spec, stage_identity

    data = Path(__file__).resolve().parents[2] / "specmesh" / "cascade" / "data"
    predictors = sorted(data.glob("predictor-smollm2-*.json"))
    assert predictors
    for path in predictors:
        for stage in json.loads(path.read_text())["stages"]:
            assert stage_identity(parse_stage_spec(stage["name"])).fingerprint == stage["fingerprint"], (path.name, stage["name"])
