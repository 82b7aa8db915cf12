"""Where quantize="gguf" finds a spec's GGUF file (no network: the cache dir is a temp folder)."""

from __future__ import annotations

import pytest

from specmesh.models import resolve
from specmesh.models.resolve import DEFAULT_GGUF_NAME, DEFAULT_MODEL_DIRNAME, GGUF_SOURCE_FILE, ModelSpecError, gguf_file


def test_gguf_file_for_each_kind_of_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_HOME", str(tmp_path / "home"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert gguf_file(str(model)) == model
    with pytest.raises(ModelSpecError, match="no such .gguf"):
        gguf_file(str(tmp_path / "missing.gguf"))

    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / GGUF_SOURCE_FILE).write_text(f"{model}\n")
    assert gguf_file(str(converted)) == model

    kept = tmp_path / "home" / "gguf" / DEFAULT_GGUF_NAME
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF")
    default_folder = tmp_path / "home" / "models" / DEFAULT_MODEL_DIRNAME
    default_folder.mkdir(parents=True)
    assert gguf_file("default") == kept
    assert gguf_file(str(default_folder)) == kept

    with pytest.raises(ModelSpecError, match="has no GGUF file"):
        gguf_file(str(tmp_path))


def test_default_gguf_is_fetched_when_an_old_cache_lacks_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_HOME", str(tmp_path))

    def fake_fetch(workdir):
        path = workdir / DEFAULT_GGUF_NAME
        path.write_bytes(b"GGUF fetched")
        return path

    monkeypatch.setattr(resolve, "_fetch_default_gguf", fake_fetch)
    path = gguf_file("default")
    assert path == tmp_path / "gguf" / DEFAULT_GGUF_NAME and path.read_bytes() == b"GGUF fetched"
