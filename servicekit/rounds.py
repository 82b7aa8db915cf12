"""Safe retries: each session remembers its last answered round, keyed by `round_index`.

    log = RoundLog()
    cached = log.replay(request)       # None: apply it; else the answer a resent round got first
    ... apply, build `response` ...
    log.remember(request, response)    # sets response.round_index

A client that times out and resends a round must not advance its session twice. A request that
carries `round_index` (the rounds the session had completed before it) is applied when the index is
the session's next one; a byte-identical resend of the last round gets that round's answer again;
anything else is FAILED_PRECONDITION. Requests without the field are applied as they come. The
last request is kept as it arrived (no serialization per round: q tensors can be megabytes) and
compared field by field only when a resend comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servicekit.errors import FailedPrecondition


@dataclass
class RoundLog:
    rounds_done: int = 0  # rounds applied: the next round's index
    last_request: Any = None  # the last applied round's request
    last_response: Any = None

    def replay(self, request: Any) -> Any:
        if not request.HasField("round_index") or request.round_index == self.rounds_done:
            return None
        if request.round_index + 1 == self.rounds_done and request == self.last_request:
            return self.last_response
        raise FailedPrecondition(f"round_index {request.round_index} does not match the session, which has completed "
                                 f"{self.rounds_done} rounds (a resend must repeat the last round exactly)")

    def remember(self, request: Any, response: Any) -> None:
        """Record an applied round; `response` (a message with a round_index field, or one holding
        such a message as `result`) gets the round's index."""
        target = response.result if hasattr(response, "result") else response
        target.round_index = self.rounds_done
        self.rounds_done += 1
        self.last_request = request
        self.last_response = response
