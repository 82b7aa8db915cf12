"""specmesh: distributed speculative decoding. The library's public names, in one import:

    from specmesh import Generator, SamplingParams                     # text in, text out
    from specmesh import load_engine, TargetVerifier, ModelDrafter, PromptLookupDrafter, generate

Each name is imported from its module on first use (PEP 562), so `import specmesh` stays cheap:
the services' generated stubs (`specmesh.proto`) and the pure modules load without torch. The modules
themselves never import from here (`from specmesh.decoding.sampling import ...`), which keeps the
package free of import cycles.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specmesh.decoding.adaptive import AdaptiveK, FixedK
    from specmesh.decoding.sampling import AcceptanceRule, SamplingParams
    from specmesh.decoding.speculative import GenerationResult, generate, speculative_stream
    from specmesh.decoding.state import FinishReason, StepEvent
    from specmesh.decoding.stats import SpecStats
    from specmesh.decoding.verifier import TargetVerifier
    from specmesh.drafters.model import ModelDrafter
    from specmesh.drafters.ngram import NgramStoreDrafter, PromptLookupDrafter
    from specmesh.generator import Generator
    from specmesh.models.load import load_engine
    from specmesh.models.resolve import resolve_model_spec

_MODULES = {  # public name -> the module that defines it
    "AdaptiveK": "specmesh.decoding.adaptive",
    "FixedK": "specmesh.decoding.adaptive",
    "AcceptanceRule": "specmesh.decoding.sampling",
    "SamplingParams": "specmesh.decoding.sampling",
    "GenerationResult": "specmesh.decoding.speculative",
    "generate": "specmesh.decoding.speculative",
    "speculative_stream": "specmesh.decoding.speculative",
    "FinishReason": "specmesh.decoding.state",
    "StepEvent": "specmesh.decoding.state",
    "SpecStats": "specmesh.decoding.stats",
    "TargetVerifier": "specmesh.decoding.verifier",
    "ModelDrafter": "specmesh.drafters.model",
    "NgramStoreDrafter": "specmesh.drafters.ngram",
    "PromptLookupDrafter": "specmesh.drafters.ngram",
    "Generator": "specmesh.generator",
    "load_engine": "specmesh.models.load",
    "resolve_model_spec": "specmesh.models.resolve",
}

__all__ = [
    "AcceptanceRule",
    "AdaptiveK",
    "FinishReason",
    "FixedK",
    "GenerationResult",
    "Generator",
    "ModelDrafter",
    "NgramStoreDrafter",
    "PromptLookupDrafter",
    "SamplingParams",
    "SpecStats",
    "StepEvent",
    "TargetVerifier",
    "generate",
    "load_engine",
    "resolve_model_spec",
    "speculative_stream",
]


def __getattr__(name: str):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'specmesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
