"""Gateway options (flags / YAML keys, parsed by `servicekit.options.parse_options`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GatewayOptions:
    host: str = "127.0.0.1"  # bind address; 0.0.0.0 to serve other hosts (use TLS then)
    port: int = 8000  # HTTP port; 0 = any free port (printed on start)
    coordinator: str = "127.0.0.1:50050"  # the Coordinator's host:port
    model: str = "default"  # the Coordinator's model spec: its tokenizer counts prompt tokens for `usage`
    served_model_name: str = ""  # the model id clients name in requests and /v1/models ("" = the model spec)
    auth_token_file: str = ""  # YAML mapping user name -> API key; set: requests need "Authorization: Bearer <key>"
    coordinator_token_file: str = ""  # a file holding the token this gateway presents to the Coordinator
    coordinator_tls_ca: str = ""  # PEM roots for TLS to the Coordinator ("" = plaintext)
    coordinator_client_cert: str = ""  # mTLS client certificate toward the Coordinator
    coordinator_client_key: str = ""
    tls_cert: str = ""  # PEM certificate chain; with tls_key the gateway serves HTTPS
    tls_key: str = ""
    max_n: int = 8  # most choices one request may ask for (n x prompts)
    max_request_mb: float = 8.0  # largest request body
    request_timeout_s: float = 600.0  # deadline of one generation on the Coordinator
    drain_grace_s: float = 30.0  # on SIGTERM: how long open requests get before the gateway stops

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
