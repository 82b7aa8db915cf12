"""The one import: `from specmesh import ...` gives the library's public names, and `import specmesh`
stays cheap (the services' stubs and the pure modules load without torch)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import specmesh


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_importing_specmesh_and_its_stubs_does_not_import_torch():
    heavy = _run("import sys, specmesh, specmesh.proto.v1.common_pb2, specmesh.proto.v1.verify_pb2_grpc; "
                 "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    assert heavy == "[]"


def test_a_public_name_imports_its_module_on_first_use():
    assert _run("import sys, specmesh; before = 'torch' in sys.modules; specmesh.SamplingParams; "
                "print(before, 'torch' in sys.modules)") == "False True"


def test_the_names_of_the_readme_import_as_one():
    from specmesh import ModelDrafter, PromptLookupDrafter, SamplingParams, TargetVerifier, generate, load_engine

    assert load_engine is importlib.import_module("specmesh.models.load").load_engine
    assert TargetVerifier is importlib.import_module("specmesh.decoding.verifier").TargetVerifier
    assert generate is importlib.import_module("specmesh.decoding.speculative").generate
    assert SamplingParams is importlib.import_module("specmesh.decoding.sampling").SamplingParams
    assert PromptLookupDrafter is importlib.import_module("specmesh.drafters.ngram").PromptLookupDrafter
    assert ModelDrafter is importlib.import_module("specmesh.drafters.model").ModelDrafter


def test_every_name_in_all_resolves_to_the_object_its_module_defines():
    assert len(set(specmesh.__all__)) == len(specmesh.__all__)
    assert set(specmesh.__all__) == set(specmesh._MODULES)
    for name in specmesh.__all__:
        value = getattr(specmesh, name)
        assert value is getattr(importlib.import_module(specmesh._MODULES[name]), name), name
    assert set(specmesh.__all__) <= set(dir(specmesh))
    namespace: dict = {}
    exec("from specmesh import *", namespace)
    assert set(specmesh.__all__) <= set(namespace)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        specmesh.nonexistent  # noqa: B018
    with pytest.raises(ImportError):
        exec("from specmesh import nonexistent", {})


def test_the_generator_takes_text_and_equals_the_pieces_underneath(tiny_model_dir):
    from specmesh import Generator, SamplingParams, TargetVerifier, generate, load_engine

    folder = tiny_model_dir("smollm2", init_std=0.2)
    gen = Generator(str(folder), drafter="ngram")
    params = SamplingParams(temperature=0, max_new_tokens=24)
    result = gen.generate("the quick brown fox jumps over the lazy dog. the quick brown fox", params)
    plain = generate(TargetVerifier(load_engine(folder)), None, gen.prompt_ids("the quick brown fox jumps over the lazy dog. the quick brown fox"), params)
    assert result.token_ids == plain.token_ids
    assert result.text == gen.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.stats.num_generated_tokens == len(result.token_ids)
    streamed = list(gen.stream([{"role": "user", "content": "Paris is the capital of"}], SamplingParams(temperature=0.8, seed=3, max_new_tokens=16)))
    again = gen.generate([{"role": "user", "content": "Paris is the capital of"}], SamplingParams(temperature=0.8, seed=3, max_new_tokens=16))
    assert [t for event in streamed for t in event.token_ids] == again.token_ids  # seeded: reproducible
    assert streamed[-1].finish_reason is not None and streamed[-1].stats is not None


def test_the_generator_names_a_bad_drafter(tiny_model_dir):
    from specmesh import Generator

    with pytest.raises(ValueError, match="unknown drafter 'eagle'"):
        Generator(str(tiny_model_dir("smollm2", init_std=0.2)), drafter="eagle")
