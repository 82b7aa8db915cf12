"""NativeEngine: the Engine contract over the native Llama-family forward and the paged KV cache.

A forward packs every sequence's new tokens end to end, appends them to the KV (all or nothing),
builds one `AttentionBatch` (positions, slots, masks) shared by all layers, runs the model once and
splits the requested logits back per sequence.

Mask worked example (one sequence, cached 2, tree tokens [a, b, c] with parents [-1, 0, -1]):
    keys:      p0 p1 a  b  c        positions: a=2, b=3, c=2
    query a:   1  1  1  0  0
    query b:   1  1  1  1  0        (b's ancestor a, and itself)
    query c:   1  1  0  0  1
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch

from specmesh.kv.cache import PagedKVCache, rows_fit
from specmesh.kv.shared import AttachedKV
from specmesh.models import fastpath, graphs
from specmesh.models.engine import (
    DEFAULT_MAX_KV_TOKENS,
    NO_PARENT,
    PREFILL_STAT_TOKENS,
    ContextLengthError,
    EngineStats,
    KvUsage,
    SeqInput,
)
from specmesh.models.llama import AttentionBatch, LlamaFamilyModel

DEFAULT_BLOCK_SIZE = 16


def tree_ancestry(parents: Sequence[int]) -> list[list[bool]]:
    """visible[i][j]: new token i may attend to new token j (j is i or an ancestor of i).

    >>> tree_ancestry([-1, 0, -1, 2])
    [[True, False, False, False], [True, True, False, False], [False, False, True, False], [False, False, True, True]]
    """
    visible: list[list[bool]] = []
    for i, parent in enumerate(parents):
        row = list(visible[parent]) if parent != NO_PARENT else [False] * len(parents)
        row[i] = True
        visible.append(row)
    return visible


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (0 = child of the prefix).

    >>> tree_depths([-1, 0, -1, 2, 3])
    [0, 1, 0, 1, 2]
    """
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent == NO_PARENT else depths[parent] + 1)
    return depths


def own_mask(item: SeqInput) -> torch.Tensor:
    """[n, n] bool: which of an input's new tokens each of them sees (its chain, or its tree's ancestry)."""
    n = len(item.token_ids)
    return torch.ones(n, n, dtype=torch.bool).tril() if item.parents is None else torch.tensor(
        tree_ancestry(item.parents), dtype=torch.bool)


def attention_rows(batch: Sequence[SeqInput]) -> list[list[int]]:
    """Indices of the batch per attention row: inputs of one group share a row (in batch order), every
    other input is a row of its own.

    >>> attention_rows([SeqInput(0, [1], [0]), SeqInput(1, [1], [0], group=7), SeqInput(2, [1], [0]),
    ...                 SeqInput(3, [1], [0], group=7)])
    [[0], [1, 3], [2]]
    """
    rows: list[list[int]] = []
    by_group: dict[int, list[int]] = {}
    for i, item in enumerate(batch):
        if item.group is None:
            rows.append([i])
        elif item.group in by_group:
            by_group[item.group].append(i)
        else:
            by_group[item.group] = [i]
            rows.append(by_group[item.group])
    return rows


def first_seen_union(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct values of `slots` in order of first appearance, the index into them of each element).

    >>> keys, index = first_seen_union(torch.tensor([4, 5, 6, 4, 5, 9, 4, 8]))
    >>> keys.tolist(), index.tolist()
    ([4, 5, 6, 9, 8], [0, 1, 2, 0, 1, 3, 0, 4])
    """
    distinct, inverse = torch.unique(slots, return_inverse=True)
    first = torch.full((distinct.shape[0],), slots.shape[0], dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(slots.shape[0]), reduce="amin")
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0])
    return distinct[order], rank[inverse]


class NativeEngine:
    backend = "native"  # Engine.backend

    def __init__(
        self,
        model: LlamaFamilyModel,
        max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        eos_token_ids: Sequence[int] = (),
    ):
        c = model.config
        self.model = model
        self.vocab_size = c.vocab_size
        self.max_context = c.max_context
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = model.device
        self.dtype = model.dtype
        self.stats = EngineStats()
        num_blocks = max(1, -(-max_kv_tokens // block_size))
        self.cache = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, model.dtype, model.device,
                                  scratch_blocks=graphs.scratch_blocks(block_size))
        self._windows = sorted(set(c.sliding_windows), key=lambda w: -1 if w is None else w)
        self._last_forward: dict[int, tuple[int, list[int] | None, int]] = {}  # seq -> (start, parents, num_new)
        self._long_prefill_fast: bool | None = None  # float32 forwards past fastpath.MAX_ROWS rows: fast path? (`_fast_eligible`)
        self.split_attention = True  # decode rows attended apart from multi-token ones (`_splits`); off: one padded batch
        # decode rows and verify chains as replayed CUDA graphs (specmesh/models/graphs.py); off: every forward eager
        self.cuda_graphs = self.device.type == "cuda" and graphs.model_supported(model)
        self.step_graphs = graphs.StepGraphs(self, capture=True) if self.cuda_graphs else None

    # sequences
    def new_sequence(self) -> int:
        return self.cache.blocks.add_sequence()

    def fork(self, seq_id: int) -> int:
        return self.cache.blocks.fork(seq_id)

    def seq_len(self, seq_id: int) -> int:
        return self.cache.blocks.length(seq_id)

    def truncate(self, seq_id: int, length: int) -> None:
        self.cache.blocks.truncate(seq_id, length)
        self._last_forward.pop(seq_id, None)

    def free(self, seq_id: int) -> None:
        self.cache.blocks.free(seq_id)
        self._last_forward.pop(seq_id, None)

    def import_kv(self, seq_id: int, source: NativeEngine | AttachedKV, source_seq_id: int, end: int) -> None:
        """Extend `seq_id` to `end` tokens with the keys and values `source` holds for those positions of
        `source_seq_id`, in this cache's dtype, instead of computing them: another engine of the same
        layers and heads over the same tokens (a self-draft taking the prompt from its target, whose
        forward of the same weights at a higher precision wrote them; `ModelDrafter`'s `kv_source`), or
        such an engine's cache in another process (`specmesh.kv.shared`)."""
        src_k, dst_k = source.cache.k, self.cache.k
        if not rows_fit(src_k.shape, dst_k.shape):
            raise ValueError(f"KV of [layers, ., kv heads, head dim] {list(src_k.shape)} does not fit {list(dst_k.shape)}")
        start, available = self.seq_len(seq_id), source.seq_len(source_seq_id)
        if not start <= end <= available:
            raise ValueError(f"cannot import positions {start}..{end} of a sequence of {available} tokens")
        if end == start:
            return
        src = source.cache.slot_tensor(source_seq_id, end)[start:]  # (on the source cache's device)
        dst = torch.tensor(self.cache.append(seq_id, end - start), dtype=torch.long, device=dst_k.device)
        dst_k[:, dst] = src_k[:, src].to(dst_k.device, dst_k.dtype)
        self.cache.v[:, dst] = source.cache.v[:, src].to(dst_k.device, dst_k.dtype)
        self._last_forward.pop(seq_id, None)

    def keep_tree_path(self, seq_id: int, node_indices: Sequence[int]) -> None:
        last = self._last_forward.get(seq_id)
        if last is None or last[0] + last[2] != self.seq_len(seq_id):
            raise ValueError(f"sequence {seq_id} has no tree forward to keep a path of")
        start, parents, num_new = last
        parents = parents if parents is not None else [i - 1 for i in range(num_new)]
        expected_parent = NO_PARENT
        for node in node_indices:
            if not 0 <= node < num_new or parents[node] != expected_parent:
                raise ValueError(f"{list(node_indices)} is not a root-to-node path of the tree {parents}")
            expected_parent = node
        self.cache.keep_path(seq_id, start, node_indices)
        self._last_forward.pop(seq_id)

    @property
    def num_free_blocks(self) -> int:
        return self.cache.blocks.num_free_blocks

    @property
    def steps_equal_chains(self) -> bool:
        """Whether a forward of a few rows (up to `fastpath.MAX_ROWS`) gives, bit for bit, the logits and KV
        of one-token steps of the same tokens, whatever else is in the batch: the CPU fast path
        (tests/engine/test_fastpath_rows.py). A drafter drafting ahead may then keep a step's KV where a
        chain would have written it (`ModelDrafter.draft_ahead_step`)."""
        return self.model.fast is not None

    @property
    def cost_steps(self) -> tuple[int, ...]:
        """New-token counts past which a forward takes another path here, so its cost jumps: the CPU fast path
        serves up to `fastpath.MAX_ROWS` (a cost profile measures both sides: specmesh/sim/profile.py)."""
        return (fastpath.MAX_ROWS,) if self.model.fast is not None else ()

    def kv_usage(self) -> KvUsage:
        blocks = self.cache.blocks
        return KvUsage(blocks.block_size, blocks.num_blocks, blocks.num_free_blocks)

    @property
    def launches_ahead(self) -> bool:
        """Whether `forward(..., timed=False)` returns with the step's kernels still queued on the device
        (CUDA), so a caller can launch the next step before it reads this one's result
        (`TargetVerifier`'s plain steps ahead). On the CPU a forward computes as it is called."""
        return self.device.type == "cuda"

    # forward
    def forward(self, batch: Sequence[SeqInput], *, timed: bool = True, feed: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One forward over a ragged batch; per input float32 logits [len(logits_at), vocab].
        `timed=False`: the step is not timed into `stats` (on CUDA timing it waits for the step's kernels;
        untimed, it returns once they are queued). `feed`: a one-element int64 tensor on the device that
        replaces the token id of a batch of one one-token input (whose own id is then a placeholder): a step
        whose input the device computes, launched before the host reads it (`TargetVerifier`'s steps ahead).
        Read on the device by the fixed-shape step; elsewhere read back first."""
        if feed is not None:
            if len(batch) != 1 or len(batch[0].token_ids) != 1 or feed.numel() != 1:
                raise ValueError("feed replaces the token of a batch of one one-token input")
            if not (self.cuda_graphs and graphs.step_shape(batch) is not None):
                item = batch[0]
                batch, feed = [SeqInput(item.seq_id, [int(feed.reshape(()))], item.logits_at, item.parents, item.group)], None
        self._validate(batch)
        if self._long_prefill_fast is None and self.model.fast is not None and self.dtype == torch.float32 \
                and sum(len(item.token_ids) for item in batch) > fastpath.MAX_ROWS:
            self._choose_long_prefill_path()  # once (before this forward's own timing and cache appends)
        begin = time.perf_counter()
        starts = [self.seq_len(item.seq_id) for item in batch]
        new_slots: list[int] = []
        appended = 0
        try:  # all or nothing: a failure (no blocks left, a kernel error) leaves every sequence as it was
            for item in batch:
                new_slots += self.cache.append(item.seq_id, len(item.token_ids))
                appended += 1
            step_graphs = self.step_graphs if self.cuda_graphs else None
            shape = graphs.step_shape(batch) if step_graphs is not None else None
            if step_graphs is not None and shape is not None:
                logits = step_graphs.forward(batch, starts, new_slots, shape, feed)
                num_rows = len(batch)
            elif self._fast_eligible(batch, starts, len(new_slots)):
                logits = self._fast_forward(batch, starts, new_slots)
                # the rows the grouped layout would attend (the stat counts layouts, whichever kernel ran)
                num_rows = len(batch) if all(item.group is None for item in batch) else len(attention_rows(batch))
            else:
                with torch.inference_mode():
                    attention, token_ids, logits_rows = self._attention_batch(batch, starts, new_slots)
                    logits = self.model.forward(token_ids, attention, self.cache, logits_rows)
                num_rows = attention.batch_size
        except BaseException:
            for item, start in zip(batch[:appended], starts):
                self.cache.blocks.truncate(item.seq_id, start)
            raise
        for item, start in zip(batch, starts):
            self._last_forward[item.seq_id] = (start, None if item.parents is None else list(item.parents), len(item.token_ids))
        self.stats.num_forwards += 1
        self.stats.num_sequences_forwarded += len(batch)
        self.stats.num_tokens_forwarded += len(new_slots)
        self.stats.num_attention_rows += num_rows
        if timed and (len(new_slots) == 1 or (len(batch) == 1 and len(new_slots) >= PREFILL_STAT_TOKENS)):
            if self.device.type == "cuda":  # the step's kernels run after this returns: time them, not their launch
                torch.cuda.synchronize(self.device)
            ms = (time.perf_counter() - begin) * 1e3
            if len(new_slots) == 1:
                self.stats.record_step(ms)
            else:
                self.stats.record_prefill(ms, len(new_slots))
        if len(batch) == 1:
            return [logits]
        return list(logits.split([len(item.logits_at) for item in batch]))

    def _fast_eligible(self, batch: Sequence[SeqInput], starts: list[int], num_tokens: int) -> bool:
        """The CPU fast path (specmesh/models/fastpath.py) serves this forward (`fastpath.serves`: a few
        rows, or a short prefill). One-sequence groups need no layout of their own there: each query reads its
        own sequence's keys through its block table, the very keys (shared prefix, then its own region) that
        the grouped layout's mask leaves it."""
        if self.model.fast is None:
            return False
        if not fastpath.serves(num_tokens, sum(len(item.token_ids) * (start + (len(item.token_ids) + 1) // 2)
                                               for item, start in zip(batch, starts)),  # a chain's rows see half its new keys
                               self.dtype):
            return False
        return num_tokens <= fastpath.MAX_ROWS or self.dtype != torch.float32 or self._long_prefill_fast is not False

    def _choose_long_prefill_path(self) -> None:
        """Whether float32 forwards past fastpath.MAX_ROWS rows that the fast path serves take it on this machine
        (`fastpath.long_prefill_on_fast_path`: measured once per machine and model shape, remembered)."""
        c = self.model.config
        shape = f"{c.num_layers}x{c.hidden_size}x{c.intermediate_size}x{c.num_heads}x{c.num_kv_heads}x{c.vocab_size}"
        self._long_prefill_fast = fastpath.long_prefill_on_fast_path(shape, self._time_long_prefills)

    def _time_long_prefills(self) -> tuple[float, float] | None:
        """Seconds of a batch of short prefills (4 x 48 tokens) on the fast path and on the torch path, the best of
        two each, on sequences of their own (freed after); None when the cache has no room for them."""
        rows, num_seqs = 48, 4
        if self.num_free_blocks < num_seqs * -(-rows // self.cache.block_size):
            return None
        stats, best = copy.deepcopy(self.stats), dict[bool, float]()  # (the engine's costs stay those of real forwards)
        for fast in (True, False, True, False):
            self._long_prefill_fast = fast
            seqs = [self.new_sequence() for _ in range(num_seqs)]
            start = time.perf_counter()
            try:
                self.forward([SeqInput(seq, [(7 * i + 3 * n) % self.vocab_size for i in range(rows)], [rows - 1])
                              for n, seq in enumerate(seqs)])
            finally:
                for seq in seqs:
                    self.free(seq)
            best[fast] = min(best.get(fast, float("inf")), time.perf_counter() - start)
        self._long_prefill_fast = None
        vars(self.stats).update(vars(stats))
        return best[True], best[False]

    def _fast_forward(self, batch: Sequence[SeqInput], starts: list[int], new_slots: list[int]) -> torch.Tensor:
        """fastpath.cpp's per-call layout (its header says it) for the batch, and the call."""
        blocks = self.cache.blocks
        tables = [blocks.block_table(item.seq_id) for item in batch]
        max_blocks = max(len(t) for t in tables)
        counts = [len(item.token_ids) for item in batch]
        n = len(new_slots)
        trees = any(item.parents is not None for item in batch)
        tree_width = max(counts) if trees else 0
        num_logits = sum(len(item.logits_at) for item in batch)
        token_ids: list[int] = []
        positions: list[int] = []
        row_seq: list[int] = []
        row_start: list[int] = []
        row_end: list[int] = []
        row_first: list[int] = []
        logits_rows: list[int] = []
        tree: list[int] = []
        for b, (item, start, count) in enumerate(zip(batch, starts, counts)):
            first = len(token_ids)
            token_ids += item.token_ids
            if item.parents is None:
                positions += range(start, start + count)
            else:
                positions += [start + d for d in tree_depths(item.parents)]
            row_seq += [b] * count
            row_start += [start] * count
            row_end += [start + count] * count
            row_first += [first] * count
            logits_rows += [first + i for i in item.logits_at]
            if trees:
                visible = own_mask(item).tolist() if item.parents is not None else [
                    [j <= i for j in range(count)] for i in range(count)]
                for row in visible:
                    tree += [int(v) for v in row] + [0] * (tree_width - count)
        meta = [n, len(batch), max_blocks, blocks.block_size, num_logits, tree_width, self.cache.k.shape[1]]
        meta += token_ids + positions + new_slots + row_seq + row_start + row_end + row_first + logits_rows
        for table in tables:
            meta += table + [0] * (max_blocks - len(table))
        meta += tree
        assert self.model.fast is not None  # `_fast_eligible`
        return self.model.fast(self.cache, meta, num_logits)

    def _validate(self, batch: Sequence[SeqInput]) -> None:
        if not batch:
            raise ValueError("empty batch")
        seen: set[int] = set()
        for item in batch:
            if item.seq_id in seen:
                raise ValueError(f"sequence {item.seq_id} appears twice in one batch")
            seen.add(item.seq_id)
            num_new = len(item.token_ids)
            if num_new == 0:
                raise ValueError(f"sequence {item.seq_id}: no new tokens")
            if self.seq_len(item.seq_id) + num_new > self.max_context:
                raise ContextLengthError(
                    f"sequence {item.seq_id} would reach {self.seq_len(item.seq_id) + num_new} tokens; "
                    f"the model's context is {self.max_context}"
                )
            if any(not 0 <= t < self.vocab_size for t in item.token_ids):
                raise ValueError(f"sequence {item.seq_id}: token id outside 0..{self.vocab_size - 1}")
            if any(not 0 <= i < num_new for i in item.logits_at):
                raise ValueError(f"sequence {item.seq_id}: logits_at outside 0..{num_new - 1}")
            if item.parents is not None:
                if len(item.parents) != num_new or any(not NO_PARENT <= p < i for i, p in enumerate(item.parents)):
                    raise ValueError(f"sequence {item.seq_id}: parents must have one entry per token, each < its index")

    def _attention_batch(self, batch: Sequence[SeqInput], starts: list[int], new_slots: list[int]):
        positions: list[int] = []
        token_ids: list[int] = []
        logits_rows: list[int] = []
        for item, start in zip(batch, starts):
            depths = range(len(item.token_ids)) if item.parents is None else tree_depths(item.parents)
            logits_rows += [len(token_ids) + i for i in item.logits_at]
            positions += [start + d for d in depths]
            token_ids += item.token_ids
        rows = attention_rows(batch)
        if len(rows) < len(batch):
            attention = self._grouped_attention(batch, rows, starts, new_slots, positions)
        elif self._splits(batch):
            attention = self._split_attention(batch, starts, new_slots, positions)
        else:
            attention = self._per_sequence_attention(batch, starts, new_slots, positions)
        device = self.device
        token_ids_t = torch.tensor(token_ids, dtype=torch.long, device=device)
        logits_rows_t = torch.tensor(logits_rows, dtype=torch.long, device=device)
        return attention, token_ids_t, logits_rows_t

    def _splits(self, batch: Sequence[SeqInput]) -> bool:
        """Whether padding every sequence to the longest one's new tokens would more than double the
        attention's queries (a prefill chunk or a long draft among decode steps): then decode rows and
        the others are attended apart (one decode row padded to a 256-token chunk costs 256 queries of
        attention over its whole context). Not for a batch-invariant model, whose attention pads nothing."""
        if not self.split_attention or len(batch) < 2 or self.model.invariant_attention:
            return False
        counts = [len(item.token_ids) for item in batch]
        return 1 in counts and len(batch) * max(counts) > 2 * sum(counts)

    def _split_attention(self, batch: Sequence[SeqInput], starts: list[int], new_slots: list[int],
                         positions: list[int]) -> AttentionBatch:
        """Sequences with one new token in one part, the rest in another (`AttentionBatch.parts`)."""
        offsets = [0]
        for item in batch:
            offsets.append(offsets[-1] + len(item.token_ids))
        parts = []
        for members in ([i for i, item in enumerate(batch) if len(item.token_ids) == 1],
                        [i for i, item in enumerate(batch) if len(item.token_ids) > 1]):
            rows = [r for i in members for r in range(offsets[i], offsets[i + 1])]
            part = self._per_sequence_attention([batch[i] for i in members], [starts[i] for i in members],
                                                [new_slots[r] for r in rows], [positions[r] for r in rows])
            parts.append((torch.tensor(rows, dtype=torch.long, device=self.device), part))
        return AttentionBatch(positions=torch.tensor(positions, dtype=torch.long, device=self.device),
                              new_slots=torch.tensor(new_slots, dtype=torch.long, device=self.device), key_slots=None,
                              masks={}, query_index=None, output_index=None, batch_size=len(batch),
                              max_new=max(len(item.token_ids) for item in batch), parts=parts)

    def _per_sequence_attention(self, batch: Sequence[SeqInput], starts: list[int], new_slots: list[int],
                                positions: list[int]) -> AttentionBatch:
        """The batching layout: one attention row per input."""
        device = self.device
        num_batch = len(batch)
        counts = [len(item.token_ids) for item in batch]
        max_new = max(counts)
        key_lengths = [start + n for start, n in zip(starts, counts)]
        max_keys = max(key_lengths)

        key_range = None
        if num_batch == 1:
            table = self.cache.blocks.block_table(batch[0].seq_id)
            if table[-1] - table[0] == len(table) - 1 and table == list(range(table[0], table[-1] + 1)):
                key_range = (table[0] * self.cache.block_size, max_keys)
        key_slots = [] if key_range else [self.cache.slot_tensor(item.seq_id) for item in batch]
        if key_range:
            key_slots_t = None
        elif num_batch == 1:
            key_slots_t = key_slots[0].unsqueeze(0)
        else:
            key_slots_t = torch.zeros(num_batch, max_keys, dtype=torch.long, device=device)
            for s, slots in enumerate(key_slots):
                key_slots_t[s, : slots.shape[0]] = slots

        simple_decode = num_batch == 1 and max_new == 1
        masks: dict[int | None, torch.Tensor | None] = {}
        if simple_decode and self._windows == [None]:
            masks[None] = None
        else:
            allowed, key_positions = self._base_mask(batch, starts, counts, max_new, max_keys, positions)
            query_positions = torch.zeros(num_batch, max_new, dtype=torch.long)
            offset = 0
            for s, n in enumerate(counts):
                query_positions[s, :n] = torch.tensor(positions[offset : offset + n])
                offset += n
            masks = self._window_masks(allowed, query_positions, key_positions)

        query_index = output_index = None
        if num_batch > 1:
            q_index: list[int] = []
            o_index: list[int] = []
            offset = 0
            for s, n in enumerate(counts):
                q_index += [offset + i for i in range(n)] + [offset] * (max_new - n)
                o_index += [s * max_new + i for i in range(n)]
                offset += n
            query_index = torch.tensor(q_index, dtype=torch.long, device=device)
            output_index = torch.tensor(o_index, dtype=torch.long, device=device)

        return AttentionBatch(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            new_slots=torch.tensor(new_slots, dtype=torch.long, device=device),
            key_slots=key_slots_t,
            masks=masks,
            query_index=query_index,
            output_index=output_index,
            batch_size=num_batch,
            max_new=max_new,
            key_range=key_range,
        )

    def _window_masks(self, allowed: torch.Tensor, query_positions: torch.Tensor,
                      key_positions: torch.Tensor) -> dict[int | None, torch.Tensor | None]:
        """allowed [B, T, K] narrowed by each sliding window of the model -> {window: [B, 1, T, K] on the device}."""
        masks: dict[int | None, torch.Tensor | None] = {}
        for window in self._windows:
            mask = allowed
            if window is not None:
                mask = allowed & ((query_positions[:, :, None] - key_positions[:, None, :]) < window)
                mask[:, :, 0] |= ~mask.any(dim=-1)  # padded rows must see something
            masks[window] = mask.unsqueeze(1).to(self.device)
        return masks

    def _grouped_attention(self, batch: Sequence[SeqInput], rows: list[list[int]], starts: list[int],
                           new_slots: list[int], positions: list[int]) -> AttentionBatch:
        """The in-one-sequence layout (engine.py: layouts): one attention row per group, its keys the union
        of the members' slots in first-seen order (the shared prefix once, then each member's region), each
        query masked to its own member's slots."""
        device = self.device
        counts = [len(item.token_ids) for item in batch]
        flat_offsets = [0]
        for n in counts:
            flat_offsets.append(flat_offsets[-1] + n)

        row_keys: list[torch.Tensor] = []  # per row: [K_r] slots
        member_keys: dict[int, torch.Tensor] = {}  # item -> index into its row's keys of each of its tokens
        for row in rows:
            slots = [self.cache.slot_tensor(batch[i].seq_id) for i in row]  # cached + new, in sequence order
            keys, key_index = first_seen_union(torch.cat(slots).cpu())
            row_keys.append(keys)
            for i, index in zip(row, key_index.split([s.shape[0] for s in slots])):
                member_keys[i] = index
        max_new = max(sum(counts[i] for i in row) for row in rows)
        max_keys = max(keys.shape[0] for keys in row_keys)
        num_rows = len(rows)
        key_slots = torch.zeros(num_rows, max_keys, dtype=torch.long)
        allowed = torch.zeros(num_rows, max_new, max_keys, dtype=torch.bool)
        key_positions = torch.zeros(num_rows, max_keys, dtype=torch.long)
        query_positions = torch.zeros(num_rows, max_new, dtype=torch.long)
        q_index: list[int] = []
        o_index = [0] * flat_offsets[-1]
        for r, row in enumerate(rows):
            keys = row_keys[r]
            key_slots[r, : keys.shape[0]] = keys
            key_slots[r, keys.shape[0]:] = keys[0]
            t = 0
            for i in row:
                start, n = starts[i], counts[i]
                index = member_keys[i]
                queries = allowed[r, t : t + n]  # a view: [n, K_max]
                queries[:, index[:start]] = True
                queries[:, index[start:]] = own_mask(batch[i])
                member_positions = torch.tensor(positions[flat_offsets[i] : flat_offsets[i + 1]])
                key_positions[r, index[:start]] = torch.arange(start)
                key_positions[r, index[start:]] = member_positions
                query_positions[r, t : t + n] = member_positions
                q_index += range(flat_offsets[i], flat_offsets[i + 1])
                for j in range(n):
                    o_index[flat_offsets[i] + j] = r * max_new + t + j
                t += n
            allowed[r, t:, 0] = True  # padded queries must see something
            q_index += [flat_offsets[row[0]]] * (max_new - t)
        # one row holding the whole batch in order: its queries are the packed tokens as they are
        identity = num_rows == 1 and q_index == list(range(flat_offsets[-1]))
        return AttentionBatch(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            new_slots=torch.tensor(new_slots, dtype=torch.long, device=device),
            key_slots=key_slots.to(device),
            masks=self._window_masks(allowed, query_positions, key_positions),
            query_index=None if identity else torch.tensor(q_index, dtype=torch.long, device=device),
            output_index=None if identity else torch.tensor(o_index, dtype=torch.long, device=device),
            batch_size=num_rows,
            max_new=max_new,
        )

    @staticmethod
    def _base_mask(batch, starts, counts, max_new, max_keys, positions):
        """allowed: [B, T, K] bool (prefix + own tree/chain), key_positions: [B, K] (CPU tensors)."""
        num_batch = len(batch)
        allowed = torch.zeros(num_batch, max_new, max_keys, dtype=torch.bool)
        key_positions = torch.zeros(num_batch, max_keys, dtype=torch.long)
        offset = 0
        for s, (item, start, n) in enumerate(zip(batch, starts, counts)):
            allowed[s, :n, :start] = True
            allowed[s, :n, start : start + n] = own_mask(item)
            allowed[s, n:, 0] = True
            key_positions[s, :start] = torch.arange(start)
            key_positions[s, start : start + n] = torch.tensor(positions[offset : offset + n])
            offset += n
        return allowed, key_positions
