"""Labelled data from real runs of a cascade's stages, and the predictor's train / evaluate steps.

Collection drives every stage in-process on each prompt, one chunk of `chunk_tokens` at a time
(a lossless cascade that runs all stages on every chunk, so every label is observed):

    stage 0:  verify_and_extend(confirmed delta, no draft, extend m)   -> chunk C_0 = proposal[:m]
    stage j:  verify_and_extend(confirmed delta, draft C_{j-1}, extend m) -> C_j = proposal[:m]
    label of stage j's row (j < N-1):  agreed       = stage j+1 accepted all of C_j  (C_{j+1} == C_j, greedy)
                                       final_agreed = C_j == C_{N-1}   (checks the chain assumption of stopping.py)
    the final stage's chunk C_{N-1} is confirmed: every stage gets it as `accepted` on the next call
Every stage extends m tokens, so each does m forwards per chunk; a stage's cost is its median
milliseconds per forward divided by the final stage's (target-forward equivalents per forward).

Rows file (JSON lines): a header {"kind": "header", "schema", "stages", "stage_forward_costs",
"chunk_tokens", "temperature", ...} and then one {"kind": "row", "prompt", "stage", "x", "agreed",
"final_agreed"} per stage and chunk. Train / eval split by prompt: prompts with index % eval_every ==
eval_every - 1 are held out, so no prompt's text is in both.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specmesh.cascade.features import FeatureSchema, SessionFeatures
from specmesh.cascade.identity import StageIdentity
from specmesh.cascade.metrics import CalibrationReport, auc, calibration_report
from specmesh.cascade.predictor import AgreementPredictor, FitConfig, check_stages
from specmesh.cascade.stage_model import StageModel
from specmesh.decoding.sampling import SamplingParams

DEFAULT_EVAL_EVERY = 4


@dataclass
class Row:
    prompt: int  # index of the prompt in the collection
    stage: int
    x: list[float]  # FeatureSchema order
    agreed: bool  # stage + 1 accepted the whole chunk
    final_agreed: bool  # the final stage's chunk equals this one


@dataclass
class Dataset:
    schema: FeatureSchema
    stages: list[StageIdentity]
    rows: list[Row]
    stage_forward_costs: list[float] = field(default_factory=list)
    header: dict = field(default_factory=dict)  # everything else the header said

    def split(self, eval_every: int = DEFAULT_EVAL_EVERY) -> tuple[list[Row], list[Row]]:
        """(train, held-out) by prompt index; eval_every <= 1 holds out nothing."""
        if eval_every <= 1:
            return list(self.rows), []
        held = [r for r in self.rows if r.prompt % eval_every == eval_every - 1]
        return [r for r in self.rows if r.prompt % eval_every != eval_every - 1], held

    def agreement_rates(self, rows: Sequence[Row] | None = None) -> list[float]:
        rows = self.rows if rows is None else rows
        rates = []
        for stage in range(self.schema.num_decision_stages):
            labels = [r.agreed for r in rows if r.stage == stage]
            rates.append(sum(labels) / len(labels) if labels else 0.5)
        return rates


def write_dataset(path: str | Path, dataset: Dataset) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        header = {**dataset.header, "kind": "header", "schema": dataset.schema.to_dict(),
                  "stages": [s.to_dict() for s in dataset.stages], "stage_forward_costs": dataset.stage_forward_costs}
        handle.write(json.dumps(header) + "\n")
        for r in dataset.rows:
            handle.write(json.dumps({"kind": "row", "prompt": r.prompt, "stage": r.stage, "x": r.x,
                                     "agreed": r.agreed, "final_agreed": r.final_agreed}) + "\n")


def read_dataset(path: str | Path) -> Dataset:
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("kind") != "header":
        raise ValueError(f"{path}: not a cascade rows file (no header line); write one with `specmesh cascade collect`")
    header = lines[0]
    schema = FeatureSchema.from_dict(header["schema"])
    rows = [Row(int(d["prompt"]), int(d["stage"]), [float(v) for v in d["x"]], bool(d["agreed"]), bool(d["final_agreed"]))
            for d in lines[1:] if d.get("kind") == "row"]
    extra = {k: v for k, v in header.items() if k not in ("kind", "schema", "stages", "stage_forward_costs")}
    return Dataset(schema, [StageIdentity.from_dict(s) for s in header["stages"]], rows,
                   [float(c) for c in header.get("stage_forward_costs", [])], extra)


def collect_prompt(stages: Sequence[StageModel], prompt: Sequence[int], prompt_index: int, schema: FeatureSchema,
                   params: SamplingParams, chunk_tokens: int, max_new_tokens: int, eos_token_ids: Sequence[int],
                   stage_ms_per_forward: list[list[float]] | None = None) -> Iterator[Row]:
    """Rows of one prompt (see the module docstring); appends each call's ms per forward per stage."""
    base_seed = params.seed if params.seed is not None else max(prompt_index, 0)
    sessions = [stage.open(prompt, params, torch.Generator().manual_seed(hash((base_seed, j)) & (2**63 - 1)))
                for j, stage in enumerate(stages)]  # a generator per stage: no shared random stream
    features = SessionFeatures(schema, len(prompt))
    confirmed: list[int] = []
    num_generated = 0
    eos = set(eos_token_ids)
    try:
        while num_generated < max_new_tokens:
            m = min(chunk_tokens, max_new_tokens - num_generated)
            chunks: list[list[int]] = []
            xs: list[list[float]] = []
            accepted_all: list[bool] = []
            draft: list[int] = []
            q: torch.Tensor | None = None
            for j, (stage, session) in enumerate(zip(stages, sessions)):
                start = time.perf_counter()
                out = stage.verify_and_extend(session, confirmed, draft, q, num_extend=m)
                if stage_ms_per_forward is not None:
                    stage_ms_per_forward[j].append((time.perf_counter() - start) * 1e3 / m)
                if j > 0:
                    accepted_all.append(out.num_accepted >= len(draft))
                if j < len(stages) - 1:
                    xs.append(features.chunk(j, out.features[:m], len(draft), out.num_accepted, num_generated))
                draft = out.proposal[:m]
                q = None if params.is_greedy or out.q is None else out.q[:m]
                chunks.append(draft)
            final = chunks[-1]
            for j in range(len(stages) - 1):
                yield Row(prompt_index, j, xs[j], accepted_all[j], chunks[j] == final)
            confirmed = final
            num_generated += len(final)
            if eos.intersection(final):
                break
    finally:
        for stage, session in zip(stages, sessions):
            stage.close(session)


def stage_forward_costs(stage_ms_per_forward: Sequence[Sequence[float]]) -> list[float]:
    """Median ms per forward of each stage / the final stage's."""
    medians = [statistics.median(ms) if ms else float("nan") for ms in stage_ms_per_forward]
    return [m / medians[-1] for m in medians]


def train_predictor(dataset: Dataset, eval_every: int = DEFAULT_EVAL_EVERY, config: FitConfig | None = None,
                    ) -> tuple[AgreementPredictor, CalibrationReport | None]:
    """Fit on the training prompts; evaluate on the held-out ones (None when there are none)."""
    train_rows, held = dataset.split(eval_every)
    if not train_rows:
        raise ValueError("no training rows (collect more prompts, or lower --eval-every)")
    predictor = AgreementPredictor(dataset.schema, dataset.stages)
    predictor.fit([r.x for r in train_rows], [float(r.agreed) for r in train_rows], config)
    predictor.info.stage_agreement_rates = dataset.agreement_rates(train_rows)
    predictor.info.stage_forward_costs = list(dataset.stage_forward_costs)
    report = None
    if held and len({r.agreed for r in held}) > 1:
        report = calibration_report(predictor.predict([r.x for r in held]), [float(r.agreed) for r in held])
        predictor.info.evaluation = {"held_out_rows": report.num_rows, "auc": report.auc, "brier": report.brier,
                                     "ece": report.ece, "agreement_rate": report.positive_rate}
    return predictor, report


@dataclass
class Evaluation:
    overall: CalibrationReport
    per_stage: dict[int, CalibrationReport]
    baseline_auc: float  # AUC of -chunk_entropy_mean alone: what the MLP must beat
    # per stage j: (observed P(final agrees with C_j), product of the observed a_i for i = j..N-2);
    # close values support the product rule of stopping.py
    final_agreement: dict[int, tuple[float, float]]


def evaluate(predictor: AgreementPredictor, dataset: Dataset, rows: Sequence[Row] | None = None) -> Evaluation:
    check_stages(predictor.stages, dataset.stages)
    rows = dataset.rows if rows is None else rows
    if not rows:
        raise ValueError("no rows to evaluate")
    probs = predictor.predict([r.x for r in rows])
    labels = np.array([float(r.agreed) for r in rows])
    per_stage = {}
    final_agreement = {}
    rates = dataset.agreement_rates(rows)
    for stage in range(dataset.schema.num_decision_stages):
        mask = np.array([r.stage == stage for r in rows])
        if mask.any():
            per_stage[stage] = calibration_report(probs[mask], labels[mask])
            observed = float(np.mean([r.final_agreed for r in rows if r.stage == stage]))
            final_agreement[stage] = (observed, float(np.prod(rates[stage:])))
    entropy = np.array([r.x[0] for r in rows])
    return Evaluation(calibration_report(probs, labels), per_stage, auc(-entropy, labels), final_agreement)
