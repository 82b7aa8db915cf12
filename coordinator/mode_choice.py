"""Which mode a Generate request runs in: the one it names, the coordinator's default, or the router's pick.

    choice = choose_mode(request, options.default_mode, request_question(request))
    choice.mode     # "speculative" | "fused" | "autoregressive" | "skeleton"
    choice.reason   # "requested", "the coordinator's default", or why the router chose

Rules, first match wins:
  1. the request names a mode: that mode, "requested" (the per-request override);
  2. the coordinator's default_mode is not "auto": that mode, "the coordinator's default";
  3. auto, a target that cannot run SoT (`skeleton_ok` False: an encoder-decoder model): plain;
  4. auto, a raw prompt: plain, since it is completed as-is and SoT would wrap it in a conversation;
  5. auto, a conversation of more than one message (a system prompt, earlier turns): plain, since SoT
     plans from the last user message alone and would drop the rest;
  6. auto, one user message: `specmesh.skeleton.router.route(question)` picks skeleton or plain, and
     its reason names the rule that matched (e.g. 'list of points: matched "tips"');
  7. ... but where SoT has lost on this target, or is not measured yet (`skeleton_closed`, from
     `specmesh.skeleton.gate.SkeletonGate`), plain, and the reason says both.
"Plain" under auto is speculative decoding (`PLAIN_MODE`), with the request's drafter.

>>> from specmesh.proto.v1 import coordinator_pb2 as pb
>>> ask = lambda text, **kw: pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)]), **kw)
>>> choose_mode(ask("Give me tips for better sleep."), "auto", "Give me tips for better sleep.")
ModeChoice(mode='skeleton', reason='list of points: matched "tips"', routed=True)
>>> choose_mode(ask("What is 17 * 23?"), "auto", "What is 17 * 23?").mode
'speculative'
>>> choose_mode(ask("tips?", mode=pb.GENERATION_MODE_FUSED), "auto", "tips?")
ModeChoice(mode='fused', reason='requested', routed=False)
>>> choose_mode(ask("Give me tips."), "auto", "Give me tips.", skeleton_closed="SoT lost on this target: plan rejected").reason
'list of points: matched "tips"; SoT lost on this target: plan rejected'
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.proto.v1 import coordinator_pb2
from specmesh.skeleton.router import Mode, route

AUTO = "auto"  # default_mode: the router decides per question when the request names no mode
PLAIN_MODE = "speculative"  # what auto runs when SoT does not fit
REQUESTED = "requested"
DEFAULT = "the coordinator's default"
NO_SKELETON = "the target model does not run SoT"
RAW_PROMPT = "a raw prompt is completed as-is (SoT needs a chat question)"
CONVERSATION = "a conversation of {num_messages} messages (SoT plans from the last user message alone)"
MODE_NAMES = {
    coordinator_pb2.GENERATION_MODE_SPECULATIVE: "speculative",
    coordinator_pb2.GENERATION_MODE_FUSED: "fused",
    coordinator_pb2.GENERATION_MODE_AUTOREGRESSIVE: "autoregressive",
    coordinator_pb2.GENERATION_MODE_SKELETON: "skeleton",
}
MODE_VALUES = {name: value for value, name in MODE_NAMES.items()}


@dataclass(frozen=True)
class ModeChoice:
    mode: str  # the mode that runs: a MODE_NAMES value
    reason: str  # why, for the stats: REQUESTED, DEFAULT, or the router's reason
    routed: bool  # the router decided (no mode in the request, default_mode "auto")

    @property
    def pb_mode(self) -> int:
        """The mode as a `GenerationMode` value."""
        return MODE_VALUES[self.mode]


def request_question(request: coordinator_pb2.GenerateRequest) -> str:
    """The question SoT plans for: the raw prompt, or the last user message of a chat (the last
    message when none is from the user; "" for an empty chat, which the prompt check rejects)."""
    if request.WhichOneof("input") == "prompt":
        return request.prompt
    messages = request.chat.messages
    return next((m.content for m in reversed(messages) if m.role == "user"), messages[-1].content if messages else "")


def choose_mode(request: coordinator_pb2.GenerateRequest, default_mode: str, question: str, *,
                skeleton_ok: bool = True, skeleton_closed: str | None = None) -> ModeChoice:
    """The mode `request` runs in (module docstring); ValueError for a mode value this coordinator does not know.
    `skeleton_ok`: the target can run SoT (False for an encoder-decoder model); `skeleton_closed`: why
    auto must not pick it now (None: it may)."""
    if request.mode != coordinator_pb2.GENERATION_MODE_UNSPECIFIED:
        if request.mode not in MODE_NAMES:
            raise ValueError(f"unknown generation mode {request.mode}")
        return ModeChoice(MODE_NAMES[request.mode], REQUESTED, routed=False)
    if default_mode != AUTO:
        return ModeChoice(default_mode, DEFAULT, routed=False)
    if not skeleton_ok:
        return ModeChoice(PLAIN_MODE, NO_SKELETON, routed=True)
    if request.WhichOneof("input") == "prompt":
        return ModeChoice(PLAIN_MODE, RAW_PROMPT, routed=True)
    if len(request.chat.messages) > 1:
        return ModeChoice(PLAIN_MODE, CONVERSATION.format(num_messages=len(request.chat.messages)), routed=True)
    decision = route(question)
    if decision.mode is Mode.SKELETON and skeleton_closed:
        return ModeChoice(PLAIN_MODE, f"{decision.reason}; {skeleton_closed}", routed=True)
    return ModeChoice("skeleton" if decision.mode is Mode.SKELETON else PLAIN_MODE, decision.reason, routed=True)
