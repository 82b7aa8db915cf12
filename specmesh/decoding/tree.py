"""Exact verification of a draft *tree*: several candidate children per position (multi-draft).

Papers: SpecInfer (Miao et al. 2024, multi-step speculative sampling) for trees of sampled
candidates; EAGLE / Medusa for tree drafts in general. Words as in `specmesh.decoding.rejection`.

Tree layout (the convention of `specmesh.models.engine`):
- nodes 0..N-1 with token_ids [N] and parents [N]; parents[i] is a node index < i, or NO_PARENT
  when node i hangs off the root, the last token already in the sequence. Siblings are tried in
  index order.
- p [1 + N, vocab]: the target's processed distributions from one forward over
  [root token, node 0, ..., node N-1]; row 0 judges the root's children, row 1 + i node i's children.
- q [N, vocab] or None: q[i] is the distribution node i's token was drawn from (at its parent).
  None = deterministic candidates (one-hot q), e.g. several n-gram continuations.

Recursive rejection sampling: start at the root with r = p[0]. For each child c in order, accept it
with probability min(1, r(x_c) / q_c(x_c)); on acceptance move to c with r = p[1 + c]. On rejection
set r = norm(max(0, r - q_c)) and try the next sibling. When every child is rejected, or the node has
none, draw the final token from r: recovered if some child was rejected, bonus otherwise.
This is exact when the children of a node were drawn independently, each from its own q_c, given
the path above them; deterministic candidates (one-hot q, drawn "from" themselves) qualify. With a
single child per node it is exactly chain speculative sampling.

Worked example (greedy; `verify_tree_greedy` needs only the target's argmax per row):
    token_ids = [5, 6, 7, 8]      parents = [-1, -1, 1, 1]     root -> 5;  root -> 6 -> {7, 8}
    target_ids = [6, 9, 8, 1, 2]  argmax at the root, after node 0, 1, 2, 3
    root wants 6: node 1; node 1 wants 8: node 3; node 3 has no children: bonus target_ids[4] = 2
    -> accepted path [1, 3], tokens [6, 8, 2]

To run the tree through the engine, feed `tree_forward_input(root_token, token_ids, parents)` and
afterwards keep `kept_forward_indices(outcome.accepted_nodes)` with `Engine.keep_tree_path`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.decoding.sampling import sample_with_uniforms
from specmesh.decoding.types import NO_PARENT, FinalTokenKind, VerifyOutcome


def validate_parents(parents: Sequence[int], num_nodes: int) -> None:
    """Raise ValueError unless parents [num_nodes] lists, per node, NO_PARENT or an earlier node."""
    if len(parents) != num_nodes:
        raise ValueError(f"parents must have one entry per node ({num_nodes}), got {len(parents)}")
    for node, parent in enumerate(parents):
        if parent != NO_PARENT and not 0 <= parent < node:
            raise ValueError(f"parents[{node}] = {parent}: must be {NO_PARENT} (the root) or an earlier node")


def chain_parents(num_nodes: int) -> list[int]:
    """The parents of a plain chain: [NO_PARENT, 0, 1, ..., num_nodes - 2]."""
    return [NO_PARENT, *range(num_nodes - 1)][:num_nodes]


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """[1 + N] lists of child nodes, in index order: entry 0 is the root's, entry 1 + i node i's.

    >>> tree_children([-1, -1, 1, 1])
    [[0, 1], [], [2, 3], [], []]
    """
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)  # NO_PARENT + 1 == 0, the root's row
    return children


def tree_forward_input(root_token_id: int, token_ids: Sequence[int], parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """Tokens and parents for the engine's tree forward: the root token first, nodes shifted by one.

    >>> tree_forward_input(4, [5, 6, 7, 8], [-1, -1, 1, 1])
    ([4, 5, 6, 7, 8], [-1, 0, 0, 2, 2])
    """
    shifted = [0 if parent == NO_PARENT else parent + 1 for parent in parents]
    return [int(root_token_id), *map(int, token_ids)], [NO_PARENT, *shifted]


def kept_forward_indices(accepted_nodes: Sequence[int]) -> list[int]:
    """The forward positions to keep after verification: the root token and the accepted path.

    >>> kept_forward_indices([1, 3])
    [0, 2, 4]
    """
    return [0, *(node + 1 for node in accepted_nodes)]


def verify_tree_greedy(token_ids: Sequence[int], parents: Sequence[int], target_ids: Sequence[int]) -> VerifyOutcome:
    """Follow the child whose token equals the target's argmax (first such sibling) as far as it goes.

    token_ids [N], parents [N], target_ids [1 + N] (argmax of the target at the root and each node).

    >>> verify_tree_greedy([5, 6, 7, 8], [-1, -1, 1, 1], [6, 9, 8, 1, 2]).token_ids
    [6, 8, 2]
    """
    validate_parents(parents, len(token_ids))
    if len(target_ids) != len(token_ids) + 1:
        raise ValueError(f"target_ids must have 1 + N = {len(token_ids) + 1} entries, got {len(target_ids)}")
    children = tree_children(parents)
    path: list[int] = []
    row = 0
    while True:
        wanted = int(target_ids[row])
        match = next((c for c in children[row] if int(token_ids[c]) == wanted), None)
        if match is None:
            break
        path.append(match)
        row = match + 1
    return VerifyOutcome(
        accepted_nodes=path,
        accepted_token_ids=[int(token_ids[node]) for node in path],
        final_token_id=int(target_ids[row]),
        final_kind=FinalTokenKind.RECOVERED if children[row] else FinalTokenKind.BONUS,
    )


def verify_tree_sampled(
    token_ids: Sequence[int],
    parents: Sequence[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator,
) -> VerifyOutcome:
    """Recursive rejection sampling over the tree (module docstring); N + 1 uniforms are drawn."""
    uniforms = torch.rand(len(token_ids) + 1, generator=generator, device=p.device, dtype=torch.float64)
    return verify_tree_sampled_with_uniforms(token_ids, parents, q, p, uniforms)


def verify_tree_sampled_with_uniforms(
    token_ids: Sequence[int],
    parents: Sequence[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    uniforms: torch.Tensor,
) -> VerifyOutcome:
    """As `verify_tree_sampled`, with the randomness given: uniforms [N + 1]; the i-th child tried
    consumes uniforms[i] (at most N tries), and uniforms[N] draws the final token by inverse CDF."""
    num_nodes = len(token_ids)
    validate_parents(parents, num_nodes)
    if p.dim() != 2 or p.shape[0] != num_nodes + 1:
        raise ValueError(f"p must be [1 + N = {num_nodes + 1}, vocab], got {tuple(p.shape)}")
    if q is not None and tuple(q.shape) != (num_nodes, p.shape[1]):
        raise ValueError(f"q must be [N = {num_nodes}, vocab = {p.shape[1]}], got {tuple(q.shape)}")
    if any(not 0 <= int(t) < p.shape[1] for t in token_ids):
        raise ValueError(f"token ids must lie in [0, {p.shape[1]})")
    children = tree_children(parents)
    accept_uniforms = uniforms[:num_nodes].tolist()
    num_tried = 0
    path: list[int] = []
    row = 0
    dist = p[0]  # r: the distribution the next candidate is judged against
    while True:
        accepted = None
        for child in children[row]:
            token = int(token_ids[child])
            q_token = 1.0 if q is None else float(q[child, token])
            u = accept_uniforms[num_tried]
            num_tried += 1
            if u * q_token < float(dist[token]):
                accepted = child
                break
            dist = _residual(dist, token if q is None else q[child])
        if accepted is None:
            break
        path.append(accepted)
        row = accepted + 1
        dist = p[row]
    final_token = sample_with_uniforms(dist[None], uniforms[num_nodes:]).item()
    return VerifyOutcome(
        accepted_nodes=path,
        accepted_token_ids=[int(token_ids[node]) for node in path],
        final_token_id=int(final_token),
        final_kind=FinalTokenKind.RECOVERED if children[row] else FinalTokenKind.BONUS,
    )


def _residual(dist: torch.Tensor, rejected: int | torch.Tensor) -> torch.Tensor:
    """norm(max(0, dist - q)) for a dense q, or for one-hot q at token `rejected` (an int).

    Zero mass means dist == q, whose rejection has probability 0: keep dist (see rejection.py)."""
    if isinstance(rejected, int):
        residual = dist.clone()
        residual[rejected] = 0.0
    else:
        residual = (dist - rejected).clamp_min(0.0)
    mass = float(residual.sum())
    return residual / mass if mass > 0 else dist
