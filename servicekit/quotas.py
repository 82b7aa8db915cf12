"""Per-principal quotas: what one caller may hold or ask for, so no caller can starve the others.

    quotas = Quotas(options)                                 # options: a QuotaOptions (0 = no limit)
    quotas.check_prompt(len(prompt))                         # per request
    quotas.check_new_session(held)                           # held: the principal's Holdings now
    quotas.check_kv(held, extra_tokens=k + 1)                # before a round grows the KV

A principal is the token's name, the client certificate's subject, `anonymous` with auth off, or the
end user a trusted caller acts for (`servicekit.auth`). Every refusal is RESOURCE_EXHAUSTED naming
the limit and its option; it changes nothing, and other principals never see it. KV tokens count
every token a principal's sessions hold (a Fork child counts its whole sequence, although it shares
its parent's blocks until it diverges: a conservative bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from servicekit.errors import QuotaExceeded


@dataclass
class QuotaOptions:
    quota_sessions: int = 0  # open sessions per principal; 0 = no limit
    quota_kv_tokens: int = 0  # tokens held by one principal's sessions together; 0 = no limit
    quota_prompt_tokens: int = 0  # prompt tokens per OpenSession; 0 = the context window
    quota_fork_children: int = 0  # children per Fork per principal; 0 = the service's max_fork_children
    quota_propose_tokens: int = 0  # accepted tokens appended per Propose; 0 = no limit
    quota_max_new_tokens: int = 0  # max_new_tokens a session may ask for; 0 = no limit


@dataclass
class Holdings:
    """What one principal holds now."""

    sessions: int = 0
    kv_tokens: int = 0


def _refuse(what: str, asked: int, limit: int, option: str) -> QuotaExceeded:
    return QuotaExceeded(f"quota exceeded: {what} {asked} > {limit} allowed per principal (--{option.replace('_', '-')})")


class Quotas:
    def __init__(self, options: QuotaOptions):
        self.options = options

    def check_new_session(self, held: Holdings, kv_tokens: int) -> None:
        o = self.options
        if o.quota_sessions and held.sessions + 1 > o.quota_sessions:
            raise _refuse("open sessions", held.sessions + 1, o.quota_sessions, "quota_sessions")
        self.check_kv(held, kv_tokens)

    def check_kv(self, held: Holdings, extra_tokens: int) -> None:
        limit = self.options.quota_kv_tokens
        if limit and held.kv_tokens + extra_tokens > limit:
            raise _refuse("KV tokens", held.kv_tokens + extra_tokens, limit, "quota_kv_tokens")

    def check_prompt(self, num_tokens: int) -> None:
        limit = self.options.quota_prompt_tokens
        if limit and num_tokens > limit:
            raise _refuse("prompt tokens", num_tokens, limit, "quota_prompt_tokens")

    def check_fork(self, num_children: int) -> None:
        limit = self.options.quota_fork_children
        if limit and num_children > limit:
            raise _refuse("Fork children", num_children, limit, "quota_fork_children")

    def check_propose(self, num_tokens: int) -> None:
        limit = self.options.quota_propose_tokens
        if limit and num_tokens > limit:
            raise _refuse("tokens appended by one Propose", num_tokens, limit, "quota_propose_tokens")

    def default_max_new_tokens(self, default: int) -> int:
        """What a request that sets no max_new_tokens gets: the service default, within the quota."""
        limit = self.options.quota_max_new_tokens
        return min(default, limit) if limit else default

    def check_max_new_tokens(self, max_new_tokens: int) -> None:
        limit = self.options.quota_max_new_tokens
        if limit and max_new_tokens > limit:
            raise _refuse("max_new_tokens", max_new_tokens, limit, "quota_max_new_tokens")
