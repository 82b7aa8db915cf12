"""Which model a cascade stage runs: a readable name plus a fingerprint of the weights and numerics.

A trained agreement predictor is only valid for the stages it saw (an int8 stage agrees with bf16
differently than a q4 one), so it is saved with the stages' identities and refuses others.

    spec "default@int8"  -> model "default", dtype float32, quantize int8
    spec "default@bf16"  -> model "default", dtype bfloat16
    spec "/models/x"     -> model "/models/x", dtype float32 (no @: full precision)
fingerprint = sha256 over (config.json, every *.safetensors / *.gguf file's sha256, dtype, quantize),
so a renamed folder with the same weights keeps its fingerprint and a retrained one does not.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from specmesh.models.load import DTYPES, QUANTIZE_KINDS, parse_dtype

WEIGHT_SUFFIXES = (".safetensors", ".gguf")


@dataclass(frozen=True)
class StageSpec:
    model: str  # a model spec: default | HF folder | .gguf | hub id
    dtype: str = "float32"
    quantize: str | None = None

    @property
    def name(self) -> str:
        return f"{self.model}@{self.quantize or _short_dtype(self.dtype)}"


@dataclass(frozen=True)
class StageIdentity:
    name: str  # e.g. "default@int8"; informative only
    fingerprint: str  # sha256 hex; what matching compares

    def to_dict(self) -> dict:
        return {"name": self.name, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, data: dict) -> StageIdentity:
        return cls(str(data["name"]), str(data["fingerprint"]))


def parse_stage_spec(text: str) -> StageSpec:
    """"MODEL[@VARIANT]" where VARIANT is a dtype (fp32, bf16, ...) or a quantize kind (int8, q4_0, ...)."""
    model, _, variant = text.rpartition("@") if "@" in text else (text, "", "")
    if not model:
        raise ValueError(f"stage {text!r}: expected MODEL[@VARIANT], e.g. default@int8")
    if not variant:
        return StageSpec(model)
    if variant in QUANTIZE_KINDS:
        return StageSpec(model, "float32", variant)
    if variant in DTYPES:
        return StageSpec(model, str(parse_dtype(variant)).removeprefix("torch."))
    raise ValueError(f"stage {text!r}: unknown variant {variant!r}; use a dtype ({', '.join(DTYPES)}) "
                     f"or a quantize kind ({', '.join(QUANTIZE_KINDS)})")


def stage_identity(spec: StageSpec) -> StageIdentity:
    from specmesh.models.resolve import resolve_model_spec

    folder = resolve_model_spec(spec.model)
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name == "config.json" or path.suffix in WEIGHT_SUFFIXES:
            stat = path.stat()
            digest.update(f"{path.name}:{_file_sha256(str(path), stat.st_size, stat.st_mtime_ns)}\n".encode())
    digest.update(f"dtype={spec.dtype}\nquantize={spec.quantize or ''}\n".encode())
    return StageIdentity(spec.name, digest.hexdigest())


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime key the cache
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _short_dtype(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(dtype, dtype)
