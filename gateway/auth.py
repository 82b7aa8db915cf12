"""Users' API keys: `Authorization: Bearer <key>` against a token file (YAML mapping user name -> key,
read by `servicekit.auth.load_tokens`, the services' format). The user's name is what the gateway
names as end user to the Coordinator. No file: every request is anonymous and names no one."""

from __future__ import annotations

import hmac

from gateway.errors import OpenAIError
from servicekit.auth import BEARER, load_tokens


class ApiKeys:
    def __init__(self, token_file: str = ""):
        self.tokens = load_tokens(token_file) if token_file else {}

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def user(self, authorization: str | None) -> str:
        """The user an Authorization header names ("" with auth off); 401 for no or an unknown key."""
        if not self.tokens:
            return ""
        if not authorization or not authorization.lower().startswith(BEARER):
            raise OpenAIError(401, "this gateway needs an API key: 'Authorization: Bearer <key>'", code="invalid_api_key")
        sent = authorization[len(BEARER):].strip().encode()
        found = ""
        for name, token in self.tokens.items():  # every entry compared: the time does not tell which matched
            if hmac.compare_digest(sent, token.encode()):
                found = name
        if not found:
            raise OpenAIError(401, "incorrect API key", code="invalid_api_key")
        return found
