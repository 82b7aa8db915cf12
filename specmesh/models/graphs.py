"""Fixed-shape steps for NativeEngine: decode rows and verify chains padded to a bucket, captured once
as CUDA graphs and replayed.

A step of B sequences, each with n_b <= T new tokens in a chain, is padded up to a bucket
(B to the next of BATCH_BUCKETS, T to the next of ROW_BUCKETS) and runs
`LlamaFamilyModel.forward_paged` over static buffers: token ids, positions, KV slots, block tables,
key and query counts. On CUDA each bucket is captured as a graph the first time it is used and
replayed after, so a step costs one launch instead of hundreds. Elsewhere (CPU tests) the very
same static step runs eagerly, which is how the layout is tested without a GPU.

Per step the host packs every number the step needs into one int64 tensor and copies it to the
device once (`_pack`): the flat part lands in the bucket's static buffer with one device copy, the
block tables (only as wide as the step needs) with another. Nothing in the captured forward reads
a value back to the host.

Padding: a sequence's rows past its n_b and the padded sequences' rows write their K/V to the
cache's scratch blocks (past the block manager's, never handed to a sequence: `scratch_blocks`)
and their logits are never read. A padded sequence reads one key of the scratch block.

Stays eager (`serves` says no): token trees and Skeleton-of-Thought groups (their masks are not
chains), prefill chunks longer than the largest row bucket, steps over MAX_ROWS padded rows,
sliding-window models, and the low-bit models (their batch-invariant attention kernel is CPU-only).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh.models.engine import SeqInput
from specmesh.models.lowbit.qweight import QuantWeight
from specmesh.models.paged_attention import PagedBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32)  # new tokens per sequence: a decode row, verify chains of k + 1
MAX_ROWS = 2048  # padded rows of one step: the float32 logits of 2048 rows x 128k vocab are 1 GiB


def model_supported(model) -> bool:
    """Whether the model's forward has a fixed-shape form: full attention in every layer, plain weights,
    a dtype the kernels take (float64 stays eager)."""
    return (model.dtype in (torch.float32, torch.bfloat16, torch.float16) and not model.invariant_attention
            and not isinstance(model.embed, QuantWeight) and all(window is None for window in model.config.sliding_windows))


def scratch_blocks(block_size: int) -> int:
    """Scratch blocks a cache needs for the padding rows of the largest row bucket."""
    return -(-ROW_BUCKETS[-1] // block_size)


def bucket(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= value, or None.

    >>> bucket(3, (1, 2, 4, 8)), bucket(8, (1, 2, 4, 8)), bucket(9, (1, 2, 4, 8))
    (4, 8, None)
    """
    index = bisect.bisect_left(buckets, value)
    return buckets[index] if index < len(buckets) else None


def step_shape(batch: Sequence[SeqInput]) -> tuple[int, int] | None:
    """(padded sequences, padded rows per sequence) of a batch the fixed-shape step serves, or None."""
    if any(item.parents is not None or item.group is not None for item in batch):
        return None
    num_batch = bucket(len(batch), BATCH_BUCKETS)
    rows = bucket(max(len(item.token_ids) for item in batch), ROW_BUCKETS)
    if num_batch is None or rows is None or num_batch * rows > MAX_ROWS:
        return None
    return num_batch, rows


@dataclass
class _Step:
    """One bucket's static buffers (and, on CUDA, its graph)."""

    flat: torch.Tensor  # [3R + 2B] int64: token ids, positions, slots (R rows each), seq_lens, query_lens (B each)
    tables: torch.Tensor  # [B, width] int64
    paged: PagedBatch
    logits: torch.Tensor | None = None  # [R, vocab] float32, the graph's output
    graph: object | None = None  # torch.cuda.CUDAGraph


class StepGraphs:
    def __init__(self, engine, capture: bool):
        """capture: record each bucket as a CUDA graph (engine on CUDA); else run the static step eagerly."""
        self.engine = engine
        self.capture = capture
        cache = engine.cache
        self.block_size = cache.block_size
        self.width = min(cache.blocks.num_blocks, -(-engine.max_context // self.block_size))
        if cache.k.shape[1] < (cache.scratch_block + scratch_blocks(self.block_size)) * self.block_size:
            raise ValueError("the KV cache has no scratch blocks for the fixed-shape step's padding")
        self._scratch_block = cache.scratch_block
        self._scratch_slot = cache.scratch_block * self.block_size
        self._steps: dict[tuple[int, int], _Step] = {}
        self._pool = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle)
        self._staging: torch.Tensor | None = None  # pinned host buffer of the packed numbers (CUDA, `_to_device`)
        self._staged: object | None = None  # torch.cuda.Event after the staging buffer's last copy
        self.num_steps = 0  # forwards served, replayed or (no capture) run eagerly
        self.num_captured = 0
        self.num_replays = 0

    def forward(self, batch: Sequence[SeqInput], starts: Sequence[int], new_slots: Sequence[int],
                shape: tuple[int, int], feed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [sum of len(logits_at), vocab] of a batch, its slots already appended; `shape`: the batch's
        `step_shape` (the caller has it, having asked whether this step serves the batch). `feed`: the first
        row's token id, on the device (`NativeEngine.forward`)."""
        step = self._steps.get(shape) or self._new_step(*shape)
        packed, width, num_logits = self._pack(batch, starts, new_slots, *shape)
        device_packed = self._to_device(packed)
        flat_size = step.flat.shape[0]
        step.flat.copy_(device_packed[:flat_size])
        step.tables[:, :width].copy_(device_packed[flat_size : flat_size + shape[0] * width].view(shape[0], width))
        if feed is not None:
            step.flat[:1].copy_(feed.reshape(1))  # after the packed copy, before the step: in the stream's order
        logits_rows = device_packed[flat_size + shape[0] * width :]
        assert logits_rows.shape[0] == num_logits
        self.num_steps += 1
        if step.graph is not None:
            with torch.cuda.device(self.engine.device):
                step.graph.replay()  # type: ignore[attr-defined]
            self.num_replays += 1
            logits = step.logits
        else:
            logits = self._run(step)
        assert logits is not None
        return logits.index_select(0, logits_rows)

    def _to_device(self, packed: torch.Tensor) -> torch.Tensor:
        """The packed numbers on the engine's device. On CUDA through a pinned staging buffer, copied
        without waiting for the device (a pageable copy waits for every queued kernel, which would stop a
        step launched ahead, `TargetVerifier`); the buffer is rewritten once its last copy is done."""
        if self.engine.device.type != "cuda":
            return packed.to(self.engine.device)
        size = packed.shape[0]
        if self._staging is None or self._staging.shape[0] < size:
            self._staging = torch.empty(max(size, 2 * (0 if self._staging is None else self._staging.shape[0])),
                                        dtype=torch.int64, pin_memory=True)
            self._staged = None
        if self._staged is not None:
            self._staged.synchronize()  # type: ignore[attr-defined]
        staging = self._staging[:size]
        staging.copy_(packed)
        device_packed = torch.empty(size, dtype=torch.int64, device=self.engine.device)
        with torch.cuda.device(self.engine.device):  # the event on the engine's stream, whichever GPU is current
            device_packed.copy_(staging, non_blocking=True)
            staged = torch.cuda.Event()
            staged.record()
            self._staged = staged
        return device_packed

    def _pack(self, batch: Sequence[SeqInput], starts: Sequence[int], new_slots: Sequence[int], num_batch: int,
              rows: int) -> tuple[torch.Tensor, int, int]:
        """(one int64 host tensor: flat part, block tables [B, width], logits rows; width; logits rows)."""
        blocks = self.engine.cache.blocks
        tables = [blocks.block_table(item.seq_id) for item in batch]
        width = max(len(table) for table in tables)
        token_ids = [0] * (num_batch * rows)
        positions = [0] * (num_batch * rows)
        slots = [self._scratch_slot] * (num_batch * rows)
        seq_lens = [1] * num_batch  # a padded sequence reads one scratch key
        query_lens = [0] * num_batch
        table_rows = [self._scratch_block] * (num_batch * width)
        logits_rows: list[int] = []
        offset = 0
        for b, (item, start, table) in enumerate(zip(batch, starts, tables)):
            n = len(item.token_ids)
            first = b * rows
            token_ids[first : first + n] = item.token_ids
            positions[first : first + n] = range(start, start + n)
            positions[first + n : first + rows] = [start] * (rows - n)
            slots[first : first + n] = new_slots[offset : offset + n]
            offset += n
            seq_lens[b] = start + n
            query_lens[b] = n
            table_rows[b * width : b * width + len(table)] = table
            logits_rows += [first + i for i in item.logits_at]
        packed = torch.tensor(token_ids + positions + slots + seq_lens + query_lens + table_rows + logits_rows,
                              dtype=torch.int64)
        return packed, width, len(logits_rows)

    def _new_step(self, num_batch: int, rows: int) -> _Step:
        device = self.engine.device
        num_rows = num_batch * rows
        flat = torch.zeros(3 * num_rows + 2 * num_batch, dtype=torch.int64, device=device)
        flat[2 * num_rows : 3 * num_rows] = self._scratch_slot  # until the first step: padding everywhere
        flat[3 * num_rows : 3 * num_rows + num_batch] = 1
        tables = torch.full((num_batch, self.width), self._scratch_block, dtype=torch.int64, device=device)
        paged = PagedBatch(block_tables=tables, seq_lens=flat[3 * num_rows : 3 * num_rows + num_batch],
                           query_lens=flat[3 * num_rows + num_batch :], block_size=self.block_size,
                           rows_per_sequence=rows)
        step = _Step(flat=flat, tables=tables, paged=paged)
        if self.capture:
            self._capture(step)
        self._steps[(num_batch, rows)] = step
        return step

    def _run(self, step: _Step) -> torch.Tensor:
        num_rows = step.paged.block_tables.shape[0] * step.paged.rows_per_sequence
        flat = step.flat
        with torch.inference_mode():
            return self.engine.model.forward_paged(flat[:num_rows], flat[num_rows : 2 * num_rows],
                                                   flat[2 * num_rows : 3 * num_rows], step.paged, self.engine.cache)

    def _capture(self, step: _Step) -> None:
        """Warm up on a side stream (Triton compiles its kernel there), then record the step into a graph
        that shares one memory pool with the other buckets (steps replay one at a time)."""
        with torch.cuda.device(self.engine.device):  # the engine's GPU, whichever is current
            self._capture_here(step)

    def _capture_here(self, step: _Step) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(step)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # type: ignore[assignment]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step.logits = self._run(step)
        step.graph = graph
        self.num_captured += 1
