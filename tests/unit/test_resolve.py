"""Model spec resolution: bad specs fail with one line naming the spec and what to do."""

import json

import pytest

from specmesh.models.resolve import ModelSpecError, resolve_model_spec


def _one_line_naming(exc_info, spec):
    message = str(exc_info.value)
    assert "\n" not in message
    assert repr(spec) in message
    return message


@pytest.mark.parametrize(
    "spec, hint",
    [
        ("./no/such/folder", "check the path"),
        ("/definitely/missing/model.gguf", "check the path"),
        ("", "pass 'default'"),
    ],
)
def test_bad_specs_give_one_line_errors(spec, hint):
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model_spec(spec)
    assert hint in str(exc_info.value)
    if spec:
        _one_line_naming(exc_info, spec)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model_spec(str(tmp_path))
    assert "config.json" in _one_line_naming(exc_info, str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model_spec(str(tmp_path))
    assert "'resnet'" in _one_line_naming(exc_info, str(tmp_path))


def test_unreachable_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelSpecError) as exc_info:
        resolve_model_spec("no-such-org/no-such-model")
    message = _one_line_naming(exc_info, "no-such-org/no-such-model")
    assert "'default'" in message


def test_local_folder_resolves_to_itself(tiny_model_dir):
    folder = tiny_model_dir("llama")
    assert resolve_model_spec(str(folder)) == folder
