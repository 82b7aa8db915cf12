"""pb <-> specmesh conversions shared by the services: sampling params, tensors, draft distributions,
model info. Everything that comes off the wire is validated here and raises ValueError."""

from __future__ import annotations

import functools
import hashlib
import math
from pathlib import Path

import numpy as np
import torch

from specmesh.decoding.sampling import AcceptanceRule, SamplingParams, resolve_seed, to_dense, to_sparse
from specmesh.decoding.state import FinishReason
from specmesh.decoding.stats import SpecStats
from specmesh.decoding.types import SparseProbs
from specmesh.kv.shared import KvRegion
from specmesh.proto.v1 import common_pb2

DEFAULT_MAX_NEW_TOKENS = 256

TORCH_BY_PB = {
    common_pb2.D_TYPE_FLOAT32: torch.float32,
    common_pb2.D_TYPE_FLOAT16: torch.float16,
    common_pb2.D_TYPE_BFLOAT16: torch.bfloat16,
    common_pb2.D_TYPE_INT64: torch.int64,
    common_pb2.D_TYPE_INT32: torch.int32,
}
PB_BY_TORCH = {v: k for k, v in TORCH_BY_PB.items()}
Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# how far a q row's sum may stray from 1: rounding each of a row's values to float16 / bfloat16 moves
# the sum by up to ~2**-11 / 2**-8 relative; float32 rows are softmax outputs and sum to 1 closely
Q_SUM_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.CONTEXT: common_pb2.FINISH_REASON_CONTEXT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}
RULE_TO_PB = {
    None: common_pb2.ACCEPTANCE_RULE_UNSPECIFIED,
    AcceptanceRule.STANDARD: common_pb2.ACCEPTANCE_RULE_STANDARD,
    AcceptanceRule.COUPLED: common_pb2.ACCEPTANCE_RULE_COUPLED,
}
RULE_FROM_PB = {v: k for k, v in RULE_TO_PB.items()}


# sampling params
def sampling_from_pb(pb: common_pb2.SamplingParams, vocab_size: int,
                     default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> SamplingParams:
    """The request's SamplingParams with a resolved seed (the server picks one when none is set) and
    acceptance rule (unspecified: the default, COUPLED): the one validation of sampling params on the
    wire (NaN, inf and out-of-range values are ValueError, see `SamplingParams.validate`)."""
    if pb.acceptance_rule not in RULE_FROM_PB:
        raise ValueError(f"unknown acceptance_rule {pb.acceptance_rule}")
    top_p = float(pb.top_p)
    params = SamplingParams(
        temperature=float(pb.temperature),
        top_k=int(pb.top_k),
        top_p=1.0 if top_p == 0 else top_p,
        seed=int(pb.seed) if pb.HasField("seed") else None,
        max_new_tokens=int(pb.max_new_tokens) or default_max_new_tokens,
        stop=list(pb.stop),
        ignore_eos=bool(pb.ignore_eos),
        acceptance_rule=RULE_FROM_PB[pb.acceptance_rule],
    )
    params.validate(vocab_size)
    return resolve_seed(params)


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        seed=params.seed, stop=list(params.stop), max_new_tokens=params.max_new_tokens, ignore_eos=params.ignore_eos,
        acceptance_rule=RULE_TO_PB[params.rule],
    )


def token_ids_from_pb(ids, vocab_size: int, what: str) -> list[int]:
    ids = list(ids)
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


# tensors
def tensor_to_pb(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> common_pb2.Tensor:
    tensor = tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
    data = tensor.view(torch.int16).numpy().tobytes() if tensor.dtype == torch.bfloat16 else tensor.numpy().tobytes()
    return common_pb2.Tensor(dtype=PB_BY_TORCH[tensor.dtype], shape=list(tensor.shape), data=data)


def tensor_from_pb(pb: common_pb2.Tensor) -> torch.Tensor:
    if pb.dtype not in TORCH_BY_PB:
        raise ValueError(f"malformed Tensor: unknown dtype {pb.dtype}")
    dtype = TORCH_BY_PB[pb.dtype]
    if any(d < 0 for d in pb.shape):
        raise ValueError(f"malformed Tensor: negative dimension in shape {list(pb.shape)}")
    numel = math.prod(pb.shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(pb.data) != numel * itemsize:
        raise ValueError(f"malformed Tensor: shape {list(pb.shape)} of {dtype} needs {numel * itemsize} bytes, got {len(pb.data)}")
    if dtype == torch.bfloat16:
        raw = np.frombuffer(pb.data, dtype=np.int16).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(tuple(pb.shape))
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32}[dtype]
    return torch.from_numpy(np.frombuffer(pb.data, dtype=np_dtype).copy()).reshape(tuple(pb.shape))


# draft distributions q
def distributions_to_pb(q: torch.Tensor, dtype: torch.dtype, sparse: bool, vocab_size: int) -> common_pb2.DraftDistributions:
    """q [k, vocab] in `dtype` (the rounded values the drafter sampled from) as dense or exact sparse."""
    if not sparse:
        return common_pb2.DraftDistributions(dense=tensor_to_pb(q, dtype))
    rows = [to_sparse(row.to("cpu", dtype)) for row in q]
    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + row.support_size)
    ids = torch.cat([r.token_ids for r in rows]) if rows else torch.zeros(0, dtype=torch.int64)
    probs = torch.cat([r.probs for r in rows]) if rows else torch.zeros(0, dtype=dtype)
    return common_pb2.DraftDistributions(sparse=common_pb2.SparseDistributions(
        offsets=offsets, token_ids=ids.tolist(), probs=tensor_to_pb(probs, dtype), vocab_size=vocab_size))


def distributions_from_pb(pb: common_pb2.DraftDistributions, k: int, vocab_size: int) -> torch.Tensor | None:
    """q [k, vocab] in the dtype it travelled in (the values the drafter sampled from, see
    `specmesh.decoding.proposal.normalize_q`), validated, or None."""
    which = pb.WhichOneof("repr")
    if which is None:
        return None
    if which == "dense":
        raw = tensor_from_pb(pb.dense)
        if tuple(raw.shape) != (k, vocab_size):
            raise ValueError(f"malformed Tensor: q must be [k={k}, vocab={vocab_size}], got {tuple(raw.shape)}")
    else:
        sp = pb.sparse
        if sp.vocab_size != vocab_size:
            raise ValueError(f"sparse q has vocab_size {sp.vocab_size}, the model has {vocab_size}")
        offsets = list(sp.offsets)
        if len(offsets) != k + 1 or offsets[0] != 0 or offsets[-1] != len(sp.token_ids) or any(
                b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"malformed SparseDistributions: offsets must be [k + 1 = {k + 1}] ascending from 0 to nnz")
        probs = tensor_from_pb(sp.probs)
        if tuple(probs.shape) != (len(sp.token_ids),):
            raise ValueError("malformed SparseDistributions: probs must be [nnz]")
        ids = torch.tensor(list(sp.token_ids), dtype=torch.int64)
        for a, b in zip(offsets, offsets[1:]):
            if len(set(sp.token_ids[a:b])) != b - a:
                raise ValueError("malformed SparseDistributions: a token id appears twice in one row")
        raw = torch.stack([to_dense(SparseProbs(ids[a:b], probs[a:b]), vocab_size) for a, b in zip(offsets, offsets[1:])]) \
            if k else torch.zeros((0, vocab_size), dtype=probs.dtype)
    if raw.dtype not in Q_DTYPES:
        raise ValueError(f"q must be float32, float16 or bfloat16, got {raw.dtype}")
    if k and (not bool(torch.isfinite(raw).all()) or bool((raw < 0).any())):
        raise ValueError("q rows must be finite and >= 0")
    if k:
        sums = raw.double().sum(-1)
        tolerance = Q_SUM_TOLERANCE[raw.dtype]
        worst = int((sums - 1).abs().argmax())
        if abs(float(sums[worst]) - 1) > tolerance:
            raise ValueError(f"q rows must be distributions: row {worst} sums to {float(sums[worst]):.6g}, "
                             f"not 1 within {tolerance:g} ({str(raw.dtype).removeprefix('torch.')})")
    return raw


def check_draft_has_q(num_draft_tokens: int, has_q: bool, deterministic_draft: bool, params: SamplingParams) -> None:
    """A sampled session's draft must come with the q it was drawn from, unless the request says the
    drafter is deterministic (q one-hot) or the session's rule reads no q (coupled): the one rule of
    Verify, Step and the Stage service."""
    if num_draft_tokens and not has_q and not deterministic_draft and params.needs_q:
        raise ValueError("a sampled session needs the draft's distributions q, or deterministic_draft = true "
                         "when the drafter is deterministic (q one-hot)")


def q_dtype_from_pb(value: int) -> torch.dtype:
    if value == common_pb2.D_TYPE_UNSPECIFIED:
        return torch.float32
    dtype = TORCH_BY_PB.get(value)
    if dtype not in Q_DTYPES:
        raise ValueError(f"q travels as float32, float16 or bfloat16, not {value}")
    return dtype


def stats_to_pb(stats: SpecStats) -> common_pb2.SpeculationStats:
    return common_pb2.SpeculationStats(
        num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens, num_accepted_tokens=stats.num_accepted_tokens,
        accepted_per_position=stats.accepted_per_position, mean_accepted_length=stats.mean_accepted_length,
        draft_ms=stats.draft_ms, verify_ms=stats.verify_ms, tokens_per_s=stats.tokens_per_s,
        num_generated_tokens=stats.num_generated_tokens, seed=stats.seed, num_target_forwards=stats.num_target_forwards,
        num_withheld_drafts=stats.num_withheld_drafts, plan=stats.plan,
    )


# model info
def kv_region_pb(region: KvRegion) -> common_pb2.KvRegion:
    """A shared KV cache's description (`specmesh.kv.shared`) as its message."""
    return common_pb2.KvRegion(pid=region.pid, fd=region.fd, inode=region.inode, device=region.device, boot_id=region.boot_id,
                               shape=list(region.shape), dtype=region.dtype, block_size=region.block_size, model=region.model)


def kv_region_from_pb(pb: common_pb2.KvRegion) -> KvRegion:
    return KvRegion(pid=pb.pid, fd=pb.fd, inode=pb.inode, device=pb.device, boot_id=pb.boot_id, shape=tuple(pb.shape),
                    dtype=pb.dtype, block_size=pb.block_size, model=pb.model)


def kv_usage_pb(usage) -> common_pb2.KvUsage:
    """An `Engine.kv_usage()` as its message."""
    return common_pb2.KvUsage(block_size=usage.block_size, total_blocks=usage.total_blocks, free_blocks=usage.free_blocks)


def tokenizer_fingerprint(folder: str | Path) -> str:
    return _fingerprint(str(folder))


@functools.lru_cache(maxsize=16)
def _fingerprint(folder: str) -> str:
    """Hashed once per folder: GetInfo answers it, and a health probe may ask often."""
    path = Path(folder) / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else ""


def model_info_pb(spec: str, folder: str | Path, engine) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model=spec, vocab_size=engine.vocab_size, max_context_tokens=engine.max_context,
        eos_token_ids=list(engine.eos_token_ids), dtype=str(engine.dtype).removeprefix("torch."),
        device=str(engine.device), backend=engine.backend,
        tokenizer_fingerprint=tokenizer_fingerprint(folder),
    )
