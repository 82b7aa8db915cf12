"""`specmesh chat`: an interactive conversation through the coordinator.

The conversation travels as chat messages (the model's chat template on the coordinator); after each
answer a line gives its acceptance, tokens/s and drafter. Commands (also in /help):

    /mode [speculative|fused|autoregressive|default]   /drafter [service|ngram|default]
    /k [N]  (0 = adaptive)   /temperature [X]   /top_k [N]   /top_p [X]   /max_tokens [N]   /seed [N|none]
    /stats   /clear   /quit (or Ctrl-D)
A command without a value shows the current one. Ctrl-C during an answer stops it (the turn is
dropped); at the prompt it does nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from dataclasses import dataclass, field

from client.cli_common import EXIT_OK, explain, fail, make_client, printer, stats_line
from client.coordinator_client import DRAFTERS, MODES, CoordinatorClient, CoordinatorError, Generation

HELP = """commands:
  /mode [speculative|fused|autoregressive|default]  show or set the generation mode
  /drafter [service|ngram|default]                  speculative mode's drafter
  /k [N]                                            draft tokens per round (0 = adaptive)
  /temperature [X]  /top_k [N]  /top_p [X]          sampling (temperature 0 = greedy)
  /max_tokens [N]   /seed [N|none]
  /stats            the last answer's stats and the coordinator's totals
  /clear            forget the conversation
  /quit             leave (also Ctrl-D)"""


@dataclass
class ChatSettings:
    mode: str = ""  # "" = the coordinator's default
    drafter: str = ""
    k: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None

    def kwargs(self) -> dict:
        return dict(mode=self.mode, drafter=self.drafter, k=self.k, temperature=self.temperature, top_k=self.top_k,
                    top_p=self.top_p, seed=self.seed, max_new_tokens=self.max_tokens)


def _choice(options):
    def parse(text: str) -> str:
        value = "" if text == "default" else text
        if value not in options:
            raise ValueError(f"choose one of {', '.join(o or 'default' for o in options)}")
        return value

    return parse


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise ValueError("must be >= 0")
        return value

    return parse


SETTINGS = {"mode": ("mode", _choice(tuple(m for m in MODES if m != "skeleton"))),
            "drafter": ("drafter", _choice(DRAFTERS)), "k": ("k", _non_negative(int)),
            "temperature": ("temperature", _non_negative(float)), "top_k": ("top_k", _non_negative(int)),
            "top_p": ("top_p", _non_negative(float)), "max_tokens": ("max_tokens", _non_negative(int)),
            "seed": ("seed", lambda text: None if text == "none" else int(text))}


@dataclass
class ChatSession:
    client: CoordinatorClient
    settings: ChatSettings
    messages: list[dict[str, str]] = field(default_factory=list)
    last: Generation | None = None

    def command(self, line: str) -> str | None:
        """Apply one slash command; returns what to print, or None to leave."""
        name, _, value = line[1:].strip().partition(" ")
        value = value.strip()
        if name in ("quit", "exit", "q"):
            return None
        if name == "help":
            return HELP
        if name == "clear":
            self.messages.clear()
            return "(conversation cleared)"
        if name in SETTINGS:
            attribute, parse = SETTINGS[name]
            if value:
                try:
                    setattr(self.settings, attribute, parse(value))
                except ValueError as exc:
                    return f"/{name} {value}: {exc}"
            shown = getattr(self.settings, attribute)
            return f"{name} = {'default' if shown == '' else shown}"
        return f"unknown command /{name}; /help lists them"

    async def stats_text(self) -> str:
        lines = []
        if self.last is not None and self.last.stats is not None:
            s = self.last.stats
            lines.append(f"last answer: {s.summary()}; {s.num_drafts} drafts, {s.num_accepted_tokens}/{s.num_draft_tokens} "
                         f"draft tokens accepted, {s.num_target_forwards} target forwards, draft {s.draft_ms:.0f} ms, "
                         f"verify {s.verify_ms:.0f} ms, seed {s.seed}")
            if s.accepted_per_position:
                lines.append("  accepted per draft, by position: " + " ".join(f"{a:.2f}" for a in s.accepted_per_draft()))
        totals = await self.client.stats()
        lines.append(f"coordinator: {totals.num_requests} requests ({totals.num_active_requests} active), "
                     f"{totals.num_generated_tokens} tokens, acceptance {totals.totals.acceptance_rate:.0%}, "
                     f"{totals.num_failovers} failovers")
        return "\n".join(lines)

    async def answer(self, text: str) -> Generation:
        self.messages.append({"role": "user", "content": text})
        try:
            result = await self.client.collect(list(self.messages), on_text=printer(), **self.settings.kwargs())
        except BaseException:
            self.messages.pop()
            raise
        if result.error_message:
            self.messages.pop()
        else:
            self.messages.append({"role": "assistant", "content": result.text})
        self.last = result
        return result


def _read(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _run(loop: asyncio.AbstractEventLoop, coroutine):
    """Run on the chat's loop; Ctrl-C cancels the coroutine (an answer's stream) and is re-raised."""
    task = loop.create_task(coroutine)
    try:
        return loop.run_until_complete(task)
    except KeyboardInterrupt:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt, CoordinatorError):
            loop.run_until_complete(task)
        raise


def chat(args: argparse.Namespace) -> int:
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
    settings = ChatSettings(mode=args.mode, drafter=args.drafter or "", k=args.k, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_new_tokens, seed=args.seed)
    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(_open(args))
    try:
        session = ChatSession(client, settings)
        try:
            _run(loop, client.health())
        except CoordinatorError as exc:
            message, code = explain(exc)
            return fail(message, code)
        print(f"specmesh chat with the coordinator at {args.address}; /help for commands, /quit to leave", flush=True)
        while True:
            try:
                line = _read("you> ")
            except KeyboardInterrupt:
                print("\n(/quit or Ctrl-D to leave)")
                continue
            if line is None:
                print()
                return EXIT_OK
            line = line.strip()
            if not line:
                continue
            try:
                if line.startswith("/"):
                    reply = _run(loop, session.stats_text()) if line.split()[0] == "/stats" else session.command(line)
                    if reply is None:
                        return EXIT_OK
                    print(reply, flush=True)
                    continue
                print("assistant> ", end="", flush=True)
                result = _run(loop, session.answer(line))
                print(flush=True)
                print(f"error: {result.error_message}" if result.error_message else stats_line(result), flush=True)
            except KeyboardInterrupt:
                print("\n[interrupted]", flush=True)
            except CoordinatorError as exc:
                print(f"\nerror: {explain(exc)[0]}", flush=True)
            except ValueError as exc:
                print(f"\nerror: {exc}", flush=True)
    finally:
        loop.run_until_complete(client.close())
        loop.close()


async def _open(args: argparse.Namespace) -> CoordinatorClient:
    return make_client(args)


def add_parser(commands, parents) -> None:
    parser = commands.add_parser("chat", parents=parents, help="an interactive conversation (/help inside)")
    parser.set_defaults(handler=chat, max_new_tokens=256)

