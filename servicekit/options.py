"""Service options as dataclasses: defaults < `--config YAML` (a flat mapping) < command-line flags.

    opts = parse_options(VerifyOptions, argv)   # --model default --port 50052 --config verify.yaml
Every field becomes a flag (`max_batch_tokens` -> `--max-batch-tokens`); the launcher passes a
cluster file's per-service mapping the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml

from specmesh.models.engine import DEFAULT_MAX_KV_TOKENS

T = TypeVar("T")


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"  # bind address; 0.0.0.0 to serve other hosts (use TLS then)
    port: int = 0  # gRPC port; 0 = any free port (printed on start)
    metrics_port: int = -1  # Prometheus /metrics port; -1 = off, 0 = any free port
    tls_cert: str = ""  # PEM certificate chain; with tls_key enables TLS
    tls_key: str = ""
    tls_client_ca: str = ""  # PEM CA; with tls_cert: client certificates required and verified (mTLS)
    auth_token_file: str = ""  # YAML mapping principal name -> token; set: RPCs need "authorization: Bearer <token>"
    trusted_callers: str = ""  # comma-separated principals that may act for an end user (specmesh-end-user)
    reflection: bool = True  # serve gRPC server reflection (v1 and v1alpha)
    drain_grace_s: float = 30.0  # on SIGTERM: refuse new sessions, wait this long for open ones, then stop
    max_message_mb: int = 64  # max gRPC message size, both directions
    session_ttl_s: float = 300.0  # idle sessions are closed after this long
    reaper_interval_s: float = 5.0


@dataclass
class ModelOptions:
    model: str = "default"  # model spec: default | folder | .gguf | hub id
    device: str = "cpu"  # cpu | cuda:N
    dtype: str = "float32"
    backend: str = "auto"  # auto | native | hf
    max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS  # KV pool size in tokens
    quantize: str = ""  # "" (as dtype says) | int8 | int4 | q4_0 | q4_1 | q8_0 | q4_k | q6_k | gguf | int8-dynamic (drafters)


@dataclass
class CoreOptions:
    """Cores lent between the model processes of one host (`servicekit.core_share`); the local launcher
    sets these from a cluster file's `cpus` / `borrow_cpus` and adds the borrowed cores to the affinity."""
    borrow_threads: int = 0  # extra intra-op threads for a job while the cores lent to it are idle
    core_board: str = ""  # the launcher's core board file; "" = none (then a verify service borrows while every
    # open session is in a Run or Generate stream: no client round in flight, nothing drafted for it)
    core_slot: int = -1  # this process's slot on the board
    lender_slots: str = ""  # comma-separated slots whose cores it borrows


def option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def options_from_mapping(cls: type[T], mapping: dict) -> T:
    known = {f.name for f in option_fields(cls)}
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise ValueError(f"unknown option(s) for {cls.__name__}: {', '.join(unknown)}")
    return cls(**mapping)


def parse_options(cls: type[T], argv: Sequence[str] | None = None, description: str = "") -> T:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML file: a flat mapping of these options")
    for f in option_fields(cls):
        kind = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool}.get(str(f.type), str)
        parser.add_argument(_flag(f.name), dest=f.name, default=None,
                            type=_parse_bool if kind is bool else kind, help=f"default {f.default!r}")
    args = parser.parse_args(argv)
    values: dict = {}
    if args.config:
        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        if not isinstance(loaded, dict):
            parser.error(f"{args.config}: expected a mapping of options")
        values.update({k.replace("-", "_"): v for k, v in loaded.items()})
    values.update({f.name: getattr(args, f.name) for f in option_fields(cls) if getattr(args, f.name) is not None})
    try:
        return options_from_mapping(cls, values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


def to_argv(mapping: dict) -> list[str]:
    """A per-service option mapping as command-line flags (the launcher's side of parse_options)."""
    argv: list[str] = []
    for key, value in mapping.items():
        argv += [_flag(key.replace("-", "_")), str(value).lower() if isinstance(value, bool) else str(value)]
    return argv
