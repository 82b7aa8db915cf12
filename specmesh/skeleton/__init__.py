"""Skeleton-of-Thought (Ning et al. 2024): plan first, then write the plan's points in parallel.

One concept per file; none of them touches a model or a socket (the answer's sessions come through
protocols: the Coordinator's gRPC adapters, or in-process objects in a test):
- answer.py    the sequence: plan -> parse -> plan check -> schedule -> fork -> branches -> merge, as events
- events.py    what it streams (plan text, branch text, branch end, merged) and its summary
- sessions.py  what it needs of a verifier (a plan-constrained session, forks) and its session wrappers
- router.py    SoT or plain decoding for a question (rules with reasons; a request can override)
- prompts.py   the skeleton prompt and each point's prompt, as chat messages
- automaton.py the skeleton format as a bounded byte-level DFA
- tokens.py    token id -> the bytes it adds (byte-level BPE, SentencePiece)
- grammar.py   the DFA over a vocabulary: exact allowed-token masks per state, applied to p and q
- parse.py     skeleton text -> Skeleton(points) or Direct(text, reason)
- schedule.py  which points start when (LPT, max_parallel, dependencies), events in, launches out
- rounds.py    a gate that sends sibling branches' verify rounds together (one target forward per round)
- tools.py     <Search>: BM25 passages from the request's documents
- merge.py     the answer: points in plan order, title + text, markers stripped

Glossary: a *point* is one line of the plan (id, est_tokens, tool, deps, title); a *branch* decodes
one point's text; a point's *dependencies* are points whose text it needs first.
"""
