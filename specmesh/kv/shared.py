"""A KV cache another process on the same host can read: a co-located Draft service takes its
context's keys and values from the Verify service's cache instead of computing them.

Why: a self-draft (the target's weights at a lower precision) in the same process copies the K/V of
its context from the target (`NativeEngine.import_kv`, `ModelDrafter(kv_source=...)`); a Draft
service in its own process used to prefill the prompt and feed every accepted token again, in bf16,
on the cores the target needs next. Here the Verify service keeps its paged K and V tensors in an
anonymous shared memory file (`memfd`), and names it in its answers (`KvRegion`: pid, descriptor,
inode, the host's boot id, shapes, the model folder). A Draft service on the same host maps the file
through `/proc/<pid>/fd/<fd>` (read only by convention: it never writes there) and, per session, is
told which blocks hold the context and how many positions are final (`TargetKv`, carried by the
Coordinator from each Verify answer to the next Propose).

Only a process that can map the file can vouch for a block table: the file starts with a random key and
an epoch per block (`header_bytes`; K and V after them), and each `TargetKv` carries a tag of the blocks,
their epochs, the length and the principal the session belongs to, keyed with the key (`kv_tag`). A
block's epoch goes up each time the block goes back to the pool (`BlockManager.on_release`). A Draft
service checks the tag for the principal calling it, against the epochs the file holds now: a caller
cannot point its drafts at rows of another principal's context, nor at blocks of its own closed session
that another session holds since (a stale table no longer matches its tag). The epochs a table was
vouched with are checked again before and after each copy from it (`AttachedKV.intact`), so a session
closed (or failed over) between a Propose and the copy it asked for gives nothing either: rows copied
from a block released meanwhile are dropped, and the session feeds its context again until a fresh
`TargetKv` comes.

What may go wrong, and why it cannot change the output:
- A region that cannot be mapped (another host, a container of its own, another model, other shapes)
  is refused: the session feeds its context as before (`attach` returns None and says why once).
- Positions below the reported length are final for the session: the target only appends after them
  or rolls back rejected rows above them, so a block of the table is released only when the session
  ends. Whatever the draft holds, the target verifies every token: a draft is only a proposal
  (shared/DESIGN.md), and the output stays the target's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh.kv.cache import PagedKVCache, block_slots, rows_fit

log = logging.getLogger(__name__)
PAGE_BYTES = 4096
KEY_BYTES = 32  # the region's key, the file's first bytes
EPOCHS_OFFSET = 64  # then one int64 per block (`header_bytes`); K and V start on the page after them
TAG_BYTES = 16
DTYPES = {str(t): t for t in (torch.float64, torch.float32, torch.bfloat16, torch.float16)}


def boot_id() -> str:
    """This host's boot id (two processes with the same one, pid and inode share a kernel and the file)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class KvRegion:
    """Where a cache's K and V live: a memfd of one process, K then V, each `shape` in `dtype`."""

    pid: int
    fd: int
    inode: int
    device: int  # st_dev of the file
    boot_id: str
    shape: tuple[int, ...]  # [num_layers, num_slots, num_kv_heads, head_dim]
    dtype: str
    block_size: int
    model: str  # the model folder the writer's weights came from (real path)

    @property
    def key(self) -> tuple:
        return self.boot_id, self.pid, self.fd, self.inode, self.device


def header_bytes(num_blocks: int) -> int:
    """Bytes before K in the file of a cache of `num_blocks` blocks: the key, the blocks' epochs, to a page."""
    return -(-(EPOCHS_OFFSET + 8 * num_blocks) // PAGE_BYTES) * PAGE_BYTES


def _epochs(fd: int, num_blocks: int, access: int) -> memoryview:
    """The file's epoch of each block, as int64 (its header, mapped)."""
    return memoryview(mmap.mmap(fd, header_bytes(num_blocks), access=access))[EPOCHS_OFFSET:].cast("q")[:num_blocks]


def _num_blocks(shape: Sequence[int], block_size: int) -> int:
    return shape[1] // block_size


@dataclass(frozen=True)
class SharedCache:
    """The writer's side of a shared cache (`share_cache`): where it lies, and what vouches for a table of it."""

    region: KvRegion
    key: bytes
    epochs: memoryview  # each block's epoch, mapped from the file (the cache's `on_release` counts them up)

    def tag(self, principal: str, blocks: Sequence[int], length: int) -> bytes:
        """The tag of a session's block table as its blocks stand now (`kv_tag`)."""
        return kv_tag(self.key, principal, blocks, [self.epochs[b] for b in blocks], length)


def share_cache(cache: PagedKVCache, model: str) -> SharedCache:
    """Move `cache`'s K and V into a shared memory file (their contents kept) and describe it. CPU caches only;
    call before forwards capture the tensors (the CPU fast path reads their addresses at each call)."""
    if cache.k.device.type != "cpu":
        raise ValueError(f"only a CPU cache can be shared between processes, not one on {cache.k.device}")
    if str(cache.k.dtype) not in DTYPES:
        raise ValueError(f"a shared cache holds floating point keys, not {cache.k.dtype}")
    shape, count, size = tuple(cache.k.shape), cache.k.numel(), cache.k.element_size()
    num_blocks = _num_blocks(shape, cache.block_size)
    fd = os.memfd_create("specmesh-kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, header_bytes(num_blocks) + 2 * count * size)
    key = os.urandom(KEY_BYTES)
    os.pwrite(fd, key, 0)
    epochs = _epochs(fd, num_blocks, mmap.ACCESS_WRITE)

    def released(block: int) -> None:  # its rows may be another sequence's from now on
        epochs[block] += 1

    cache.blocks.on_release = released
    head = header_bytes(num_blocks) // size
    both = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=head + 2 * count, dtype=cache.k.dtype)
    k, v = both[head:head + count].view(shape), both[head + count:].view(shape)
    if cache.blocks.num_free_blocks < cache.blocks.num_blocks:  # live sequences (else nothing to keep: the file's
        k.copy_(cache.k)  # pages stay untouched, so unused, until tokens are written)
        v.copy_(cache.v)
    cache.k, cache.v = k, v
    stat = os.fstat(fd)  # the descriptor stays open for the process's life: readers open it by /proc path
    region = KvRegion(os.getpid(), fd, stat.st_ino, stat.st_dev, boot_id(), shape, str(cache.k.dtype), cache.block_size,
                      os.path.realpath(model))
    return SharedCache(region, key, epochs)


def kv_tag(key: bytes, principal: str, blocks: Sequence[int], epochs: Sequence[int], length: int) -> bytes:
    """What vouches that `blocks`, at these `epochs`, and `length` are where a session of `principal` lies
    (module docstring)."""
    if len(epochs) != len(blocks):
        raise ValueError(f"one epoch per block: {len(epochs)} for {len(blocks)} blocks")
    message = (principal.encode() + b"\0" + struct.pack(f"<{len(blocks) + 1}I", length, *blocks)
               + struct.pack(f"<{len(epochs)}q", *epochs))
    return hmac.new(key, message, hashlib.sha256).digest()[:TAG_BYTES]


class AttachedKV:
    """Another process's shared cache, mapped here: a `kv_source` for `NativeEngine.import_kv`.

    Each session that takes KV from it is a key here, with the writer's block table for the session, the
    blocks' epochs it was vouched at and how many of its positions are final (`set`, before each proposal).
    A table whose blocks were released since has nothing to give (`seq_len` 0, module docstring)."""

    def __init__(self, region: KvRegion, k: torch.Tensor, v: torch.Tensor, key: bytes, epochs: Sequence[int]):
        self.region = region
        self.k, self.v = k, v
        self.key = key
        self.epochs = epochs  # each block's epoch, as the writer counts them (mapped from its file)
        self.block_size = region.block_size
        self._tables: dict[int, tuple[list[int], int, list[int]]] = {}
        self._offsets = torch.arange(region.block_size)

    @property
    def cache(self) -> AttachedKV:  # `import_kv` reads `source.cache.k / .v / .slot_tensor`
        return self

    def vouch(self, principal: str, blocks: Sequence[int], length: int, tag: bytes) -> list[int] | None:
        """The epochs at which the writer tagged this block table for a session of `principal` (`kv_tag`),
        if it did and no block of it was released since; else None."""
        self._check(blocks, length)
        epochs = [self.epochs[b] for b in blocks]
        return epochs if hmac.compare_digest(kv_tag(self.key, principal, blocks, epochs, length), tag) else None

    def set(self, key: int, blocks: list[int], length: int, epochs: list[int]) -> None:
        """Session `key`'s table: `blocks` at `epochs` (what `vouch` said), the first `length` positions final."""
        self._check(blocks, length)
        if len(epochs) != len(blocks):
            raise ValueError(f"one epoch per block: {len(epochs)} for {len(blocks)} blocks")
        self._tables[key] = (blocks, length, epochs)

    def _check(self, blocks: Sequence[int], length: int) -> None:
        if length > len(blocks) * self.block_size:
            raise ValueError(f"{len(blocks)} blocks of {self.block_size} cannot hold {length} positions")
        num_blocks = len(self.epochs)
        if any(not 0 <= b < num_blocks for b in blocks):
            raise ValueError(f"a block id is outside the shared cache's {num_blocks} blocks")

    def intact(self, key: int) -> bool:
        """Whether no block of session `key`'s table went back to the writer's pool since it was vouched for."""
        table = self._tables.get(key)
        return table is not None and all(self.epochs[b] == e for b, e in zip(table[0], table[2], strict=True))

    def forget(self, key: int) -> None:
        self._tables.pop(key, None)

    def writer_alive(self) -> bool:
        """Whether the process that shares this cache still does (its descriptor names the same file): a mapping of
        a writer that exited keeps the memory of its cache alive, and nothing will be written there again."""
        try:
            stat = os.stat(f"/proc/{self.region.pid}/fd/{self.region.fd}")
        except OSError:
            return False
        return (stat.st_ino, stat.st_dev) == (self.region.inode, self.region.device)

    def seq_len(self, key: int) -> int:
        """Positions of session `key` there are to take: none once its table is stale."""
        return self._tables[key][1] if self.intact(key) else 0

    def slot_tensor(self, key: int, length: int) -> torch.Tensor:
        return block_slots(self._tables[key][0], self._offsets, length)


def attach(region: KvRegion, model: str, k_shape: torch.Size) -> AttachedKV | None:
    """Map `region` if it is another process's cache on this host, of `model` and of K rows shaped like
    `k_shape` ([layers, ., kv heads, head dim]); None (and why, in the log) where it cannot be used."""
    why = _unusable(region, model, k_shape)
    if why is None:
        path = f"/proc/{region.pid}/fd/{region.fd}"
        try:
            stat = os.stat(path)
            if (stat.st_ino, stat.st_dev) != (region.inode, region.device):
                why = f"{path} is not the file the Verify service named"
            else:
                dtype, count = DTYPES[region.dtype], 1
                for n in region.shape:
                    count *= n
                num_blocks = _num_blocks(region.shape, region.block_size)
                head = header_bytes(num_blocks) // torch.empty((), dtype=dtype).element_size()
                both = torch.from_file(path, shared=True, size=head + 2 * count, dtype=dtype)
                with open(path, "rb") as f:
                    key = f.read(KEY_BYTES)
                    epochs = _epochs(f.fileno(), num_blocks, mmap.ACCESS_READ)  # (the mapping outlives the descriptor)
                return AttachedKV(region, both[head:head + count].view(region.shape), both[head + count:].view(region.shape), key,
                                  epochs)
        except (OSError, RuntimeError) as exc:
            why = f"cannot map {path}: {exc}"
    log.info("not taking the target's KV from its shared cache: %s; drafts feed their context", why)
    return None


def _unusable(region: KvRegion, model: str, k_shape: torch.Size) -> str | None:
    if region.boot_id != boot_id() or not region.boot_id:
        return "the Verify service runs on another host"
    if region.dtype not in DTYPES or len(region.shape) != 4 or region.block_size <= 0:
        return f"a malformed region ({region.dtype}, shape {list(region.shape)}, block size {region.block_size})"
    if region.model != os.path.realpath(model):
        return f"the target's model is {region.model}, this draft's {os.path.realpath(model)}"
    if not rows_fit(region.shape, k_shape):
        return f"its K rows {list(region.shape)} do not fit this cache's {list(k_shape)}"
    return None
