"""Which model a cascade stage runs: a readable name plus a fingerprint of the weights and numerics.

A trained agreement predictor is only valid for the stages it saw (an int8 stage agrees with bf16
differently than a q4 one), so it is saved with the stages' identities and refuses others.

    spec "default@int8"  -> model "default", dtype float32, quantize int8
    spec "default@bf16"  -> model "default", dtype bfloat16
    spec "/models/x"     -> model "/models/x", dtype float32 (no @: full precision)
fingerprint = sha256 over (the architecture, every weight file's content, dtype, quantize), so a renamed
folder with the same weights keeps its fingerprint and a retrained one does not. Only what decides
the numbers counts: the architecture is the config as the native forward reads it (`LlamaFamilyConfig`;
other models: config.json less the keys a converter stamps, `VOLATILE_CONFIG_KEYS`), and a
.safetensors file counts by its tensors (name, dtype, shape, bytes; not its header's metadata or
order). A converter of another transformers version writes another config.json for the same model
(`transformers_version`, `rope_theta` or `rope_parameters`, ...): the fingerprint stays.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from specmesh.models.config import NATIVE_MODEL_TYPES, LlamaFamilyConfig
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

    folder = Path(resolve_model_spec(spec.model))
    return StageIdentity(spec.name, fingerprint(folder, spec.dtype, spec.quantize))


def fingerprint(folder: Path, dtype: str = "float32", quantize: str | None = None) -> str:
    """The sha256 hex of a model folder's architecture and weights at `dtype` / `quantize` (module docstring)."""
    digest = hashlib.sha256()
    if folder.is_file():  # a .gguf spec: the file is the model
        folder, files = folder.parent, [folder]
    else:
        files = sorted(path for path in folder.iterdir() if path.suffix in WEIGHT_SUFFIXES)
        digest.update(f"config:{_architecture(folder / 'config.json')}\n".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.suffix}:{_content_sha256(str(path), stat.st_size, stat.st_mtime_ns)}\n".encode())
    digest.update(f"dtype={dtype}\nquantize={quantize or ''}\n".encode())
    return digest.hexdigest()


VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "_model_name_or_path", "dtype", "torch_dtype",
                                  "use_cache", "architectures"})  # stamped by whoever wrote the file, not the model


def _architecture(config_path: Path) -> str:
    """The config as the numbers depend on it, as canonical text (module docstring); "" without a config."""
    if not config_path.exists():
        return ""
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") in NATIVE_MODEL_TYPES:
        from transformers import AutoConfig

        try:
            return json.dumps(dataclasses.asdict(LlamaFamilyConfig.from_hf(AutoConfig.from_pretrained(config_path.parent))),
                              sort_keys=True)
        except ValueError:  # a family member the native forward does not run: its file, as below
            pass
    return json.dumps({k: v for k, v in raw.items() if k not in VOLATILE_CONFIG_KEYS}, sort_keys=True)


@functools.lru_cache(maxsize=64)
def _content_sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime key the cache
    """A .safetensors file's tensors in name order (name, dtype, shape, bytes); any other file's bytes."""
    if not path.endswith(".safetensors"):
        return _file_sha256(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header_len = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + header_len])
        base = 8 + header_len
        for name in sorted(k for k in header if k != "__metadata__"):
            entry = header[name]
            start, end = entry["data_offsets"]
            digest.update(f"{name}:{entry['dtype']}:{entry['shape']}\n".encode())
            digest.update(data[base + start:base + end])
    return digest.hexdigest()


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _short_dtype(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(dtype, dtype)
