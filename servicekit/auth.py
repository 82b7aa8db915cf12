"""Who is calling: the principal of the current RPC, resolved once per call at the server edge.

    policy = AuthPolicy.from_options(options)                 # --auth-token-file, --tls-client-ca, --trusted-callers
    principal = policy.resolve(metadata, auth_context)         # Unauthenticated / PermissionDenied
    with principal_scope(principal):                           # servicekit.server does this per call
        ... current_principal() ...                            # session ownership, quotas

The caller is
- with `--auth-token-file` (a YAML mapping name -> token): the name of the token sent as metadata
  `authorization: Bearer <token>`; no or an unknown token is UNAUTHENTICATED;
- else with `--tls-client-ca` (mTLS: the transport has verified the client certificate): the
  certificate subject's common name (CN); the full subject when it has no CN;
- else `anonymous`.
With both a token file and mTLS, the certificate admits the connection and the token names the caller.

A trusted caller (`--trusted-callers coordinator,gateway`) may act for an end user by sending
`specmesh-end-user: <name>`; the principal is then `<caller>/<name>`, e.g. `gateway/alice`: scoped by
the caller, so two gateways' "alice" (or a gateway's "alice" and a token named alice) never share
sessions or quotas, and a chain (gateway -> coordinator) reads `coordinator/gateway/alice`. Caller
names therefore may not contain "/". Any other caller naming someone other than itself is
PERMISSION_DENIED.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from servicekit.errors import PermissionDenied, Unauthenticated

ANONYMOUS = "anonymous"
AUTHORIZATION_KEY = "authorization"  # metadata keys are lower case on the wire
END_USER_KEY = "specmesh-end-user"
BEARER = "bearer "
MAX_END_USER_CHARS = 256
_principal: contextvars.ContextVar[str] = contextvars.ContextVar("specmesh_principal", default=ANONYMOUS)


def current_principal() -> str:
    """The principal of the RPC being served (`anonymous` outside one, or with auth off)."""
    return _principal.get()


@contextmanager
def principal_scope(principal: str) -> Iterator[None]:
    """Make `principal` the current one for the block (one RPC: the server runs each in its own task).
    The block must end in the task (context) it began in: `servicekit.server` runs a streaming call as
    one coroutine, never as a generator another task may finalize."""
    token = _principal.set(principal)
    try:
        yield
    finally:
        _principal.reset(token)


def load_tokens(path: str | Path) -> dict[str, str]:
    """Read a token file: a YAML mapping principal name -> token. Names may not contain "/" (reserved
    for end users) and no two names may share a token."""
    loaded = yaml.safe_load(Path(path).read_text())
    if not isinstance(loaded, dict) or not loaded:
        raise ValueError(f"{path}: expected a non-empty mapping of principal name -> token")
    tokens: dict[str, str] = {}
    for name, token in loaded.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{path}: principal name {name!r} must be a non-empty string without '/'")
        if not isinstance(token, str) or not token:
            raise ValueError(f"{path}: the token of {name!r} must be a non-empty string")
        tokens[name] = token
    if len(set(tokens.values())) != len(tokens):
        raise ValueError(f"{path}: two principals share a token")
    return tokens


def _values(metadata: Iterable[Any], key: str) -> list[str]:
    return [value.decode() if isinstance(value, bytes) else value for k, value in metadata if k == key]


def _first(auth_context: Mapping[str, Sequence[bytes]], key: str) -> str:
    values = auth_context.get(key) or []
    return values[0].decode() if values else ""


@dataclass(frozen=True)
class AuthPolicy:
    tokens: Mapping[str, str] = field(default_factory=dict)  # name -> token; empty = no token needed
    mtls: bool = False  # the transport verified a client certificate: its subject names the caller
    trusted_callers: frozenset[str] = frozenset()  # may act for end users

    @classmethod
    def from_options(cls, options: Any) -> AuthPolicy:
        """From a ServerOptions (auth_token_file, tls_client_ca, trusted_callers)."""
        tokens = load_tokens(options.auth_token_file) if options.auth_token_file else {}
        trusted = frozenset(name.strip() for name in options.trusted_callers.split(",") if name.strip())
        return cls(tokens, bool(options.tls_client_ca), trusted)

    def caller(self, metadata: Iterable[Any], auth_context: Mapping[str, Sequence[bytes]]) -> str:
        """Who is on the other end of the call, before any acting for an end user."""
        if self.tokens:
            headers = _values(metadata, AUTHORIZATION_KEY)
            if len(headers) != 1 or not headers[0].lower().startswith(BEARER):
                raise Unauthenticated("this service needs metadata 'authorization: Bearer <token>'")
            sent = headers[0][len(BEARER):].strip().encode()
            found = ""
            for name, token in self.tokens.items():  # every entry compared: time does not tell which matched
                if hmac.compare_digest(sent, token.encode()):
                    found = name
            if not found:
                raise Unauthenticated("unknown token")
            return found
        if self.mtls:
            subject = _first(auth_context, "x509_common_name") or _first(auth_context, "x509_subject")
            if not subject:
                raise Unauthenticated("no verified client certificate")
            if "/" in subject:
                raise Unauthenticated(f"client certificate subject {subject!r} contains '/', reserved for end users")
            return subject
        return ANONYMOUS

    def resolve(self, metadata: Iterable[Any], auth_context: Mapping[str, Sequence[bytes]]) -> str:
        """The effective principal of a call: the caller, or `<caller>/<end user>` for a trusted
        caller acting for one (module docstring)."""
        metadata = list(metadata)
        caller = self.caller(metadata, auth_context)
        end_users = _values(metadata, END_USER_KEY)
        if len(end_users) > 1:
            raise ValueError(f"at most one '{END_USER_KEY}' metadata entry, got {len(end_users)}")
        end_user = end_users[0].strip() if end_users else ""
        if not end_user or end_user == caller:
            return caller
        if caller not in self.trusted_callers:
            raise PermissionDenied(f"{caller!r} may not act for end user {end_user!r} (not a --trusted-callers entry)")
        if len(end_user) > MAX_END_USER_CHARS:
            raise ValueError(f"'{END_USER_KEY}' is longer than {MAX_END_USER_CHARS} characters")
        return f"{caller}/{end_user}"
