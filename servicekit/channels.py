"""Client channels to specmesh services: plaintext or TLS (mTLS with a client certificate), with a
bearer token and an end user sent on every call.

    async with open_channel("verify.internal:50052", tls_ca="ca.pem", token=os.environ["SPECMESH_TOKEN"]) as ch:
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
    with open_channel("127.0.0.1:50052", aio=False) as ch:     # a blocking channel (scripts, health probes)
        ...
The token travels as `authorization: Bearer <token>` and the end user as `specmesh-end-user` (see
`servicekit.auth` for what the server makes of them). They are added by a client interceptor rather
than call credentials, because grpc sends call credentials only over a secure channel and a token
over plaintext is a legitimate choice on a private network or loopback.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from servicekit.auth import AUTHORIZATION_KEY, END_USER_KEY

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the services' default --max-message-mb: q tensors exceed grpc's 4 MB
DEFAULT_OPTIONS = [("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES)]
Metadata = list[tuple[str, str]]


def call_metadata(token: str = "", end_user: str = "") -> Metadata:
    """The metadata every call carries for this token and end user (empty: none)."""
    metadata = [(AUTHORIZATION_KEY, f"Bearer {token}")] if token else []
    return metadata + ([(END_USER_KEY, end_user)] if end_user else [])


def channel_credentials(tls_ca: str = "", client_cert: str = "", client_key: str = "") -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files (no `tls_ca`: the system roots), or None for plaintext when no
    file is named. A client certificate needs its key (mTLS)."""
    if bool(client_cert) != bool(client_key):
        raise ValueError("a client certificate needs both client_cert and client_key")
    if not (tls_ca or client_cert):
        return None
    read = lambda path: Path(path).read_bytes() if path else None
    return grpc.ssl_channel_credentials(root_certificates=read(tls_ca), private_key=read(client_key),
                                        certificate_chain=read(client_cert))


class _AioMetadata:
    """Appends fixed metadata to the calls of an asyncio channel. grpc.aio files each interceptor
    under the first call kind it implements, hence one subclass per kind (`aio_interceptors`)."""

    def __init__(self, metadata: Metadata):
        self.metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self.metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _AioUnaryUnary(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioUnaryStream(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioStreamUnary(_AioMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _AioStreamStream(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def aio_interceptors(metadata: Metadata) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding `metadata` to every call (all four call kinds) of a grpc.aio channel."""
    return [kind(metadata) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _CallDetails(namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
                   grpc.ClientCallDetails):
    pass


class _SyncMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Appends fixed metadata to every call of a blocking channel."""

    def __init__(self, metadata: Metadata):
        self.metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [*(details.metadata or ()), *self.metadata]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def open_channel(address: str, *, tls_ca: str = "", client_cert: str = "", client_key: str = "", token: str = "",
                 end_user: str = "", aio: bool = True, options: Sequence[tuple[str, Any]] | None = None) -> Any:
    """A channel to `address`: grpc.aio.Channel (aio=True) or grpc.Channel. TLS when `tls_ca` or a
    client certificate is named (PEM file paths); `token` / `end_user` go with every call. `options`
    default to 64 MB messages both ways."""
    credentials = channel_credentials(tls_ca, client_cert, client_key)
    options = DEFAULT_OPTIONS if options is None else list(options)
    metadata = call_metadata(token, end_user)
    if aio:
        interceptors = aio_interceptors(metadata) if metadata else None
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    channel = grpc.insecure_channel(address, options=options) if credentials is None else grpc.secure_channel(
        address, credentials, options=options)
    return grpc.intercept_channel(channel, _SyncMetadata(metadata)) if metadata else channel
