"""AgreementPredictor: a small MLP giving P(stage j+1 agrees with stage j's chunk) from chunk features.

    standardise (training mean / std) -> Linear(d, hidden) -> tanh -> Linear(hidden, 1) -> sigmoid
Trained full-batch with Adam on binary cross-entropy (plus a little weight decay), seeded, so a fit on
the same rows gives the same model. Inputs are `features.FeatureSchema` vectors (stage one-hot included:
one model for every decision stage).

Saved as one JSON file (weights as lists: a few thousand numbers; no pickle), with what it is valid for:
the feature schema and the stages' identities (`identity.StageIdentity`, in cascade order). `load`
with `expected_stages` refuses a file trained for other stages, naming both, and any file whose schema
version is not this code's. The file also carries the training rows' agreement rate per stage (the
shrinkage prior, see `shrinkage.py`), the stages' measured costs and the evaluation it passed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specmesh.cascade.features import SCHEMA_VERSION, FeatureSchema
from specmesh.cascade.identity import StageIdentity

FILE_FORMAT = "specmesh-cascade-predictor"
FILE_VERSION = 1
MIN_STD = 1e-6  # a feature whose training std is below this is constant there (e.g. a stage's one-hot in
# single-stage data, or the lower draft's accepted fraction at a stage that had no draft): the model
# ignores it (zero input weights), so a value it never saw in training cannot swing the prediction


class PredictorMismatchError(ValueError):
    """A saved predictor was trained for other stages or another feature schema."""


@dataclass
class FitConfig:
    hidden: int = 32
    epochs: int = 400
    lr: float = 0.01
    weight_decay: float = 1e-3
    seed: int = 0


@dataclass
class PredictorInfo:
    """What the file records besides the weights."""

    stage_agreement_rates: list[float] = field(default_factory=list)  # per decision stage, training rows
    stage_forward_costs: list[float] = field(default_factory=list)  # per stage, target-forward equivalents
    num_training_rows: int = 0
    evaluation: dict = field(default_factory=dict)  # free-form metrics (AUC, ECE, ...) of the held-out rows


class AgreementPredictor:
    def __init__(self, schema: FeatureSchema, stages: Sequence[StageIdentity], hidden: int = 32):
        if len(stages) != schema.num_stages:
            raise ValueError(f"{len(stages)} stage identities for a {schema.num_stages}-stage schema")
        self.schema = schema
        self.stages = list(stages)
        self.info = PredictorInfo()
        d = schema.num_features
        self.mean = torch.zeros(d, dtype=torch.float64)
        self.std = torch.ones(d, dtype=torch.float64)
        self.net = _mlp(d, hidden)

    def _inputs(self, x: Sequence[Sequence[float]] | np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(x, dtype=np.float64))
        if t.dim() != 2 or t.shape[1] != self.schema.num_features:
            raise ValueError(f"expected rows of {self.schema.num_features} features, got shape {tuple(t.shape)}")
        return (t - self.mean) / self.std

    def fit(self, x: Sequence[Sequence[float]] | np.ndarray, agreed: Sequence[float] | np.ndarray,
            config: FitConfig | None = None) -> list[float]:
        """Fit on rows x [n, d] and labels agreed [n] (1 = the next stage agreed). Returns the loss per epoch."""
        config = config or FitConfig()
        raw = torch.as_tensor(np.asarray(x, dtype=np.float64))
        y = torch.as_tensor(np.asarray(agreed, dtype=np.float64)).reshape(-1)
        if raw.dim() != 2 or raw.shape[0] != y.shape[0] or raw.shape[0] == 0:
            raise ValueError(f"fit needs rows [n, d] and n labels, got {tuple(raw.shape)} and {tuple(y.shape)}")
        self.mean = raw.mean(dim=0)
        std = raw.std(dim=0, unbiased=False)
        constant = std < MIN_STD
        self.std = torch.where(constant, torch.ones_like(std), std)
        inputs = self._inputs(raw)
        generator = torch.Generator().manual_seed(config.seed)
        self.net = _mlp(self.schema.num_features, config.hidden)
        with torch.no_grad():
            for layer in (self.net[0], self.net[2]):
                assert isinstance(layer, torch.nn.Linear)
                bound = 1.0 / layer.in_features ** 0.5
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
        optimizer = torch.optim.Adam(self.net.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        losses = []
        self.net.train()
        for _ in range(config.epochs):
            optimizer.zero_grad()
            loss = loss_fn(self.net(inputs).squeeze(-1), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        with torch.no_grad():
            first = self.net[0]
            assert isinstance(first, torch.nn.Linear)
            first.weight[:, constant] = 0.0
        self.net.eval()
        self.info.num_training_rows = int(y.shape[0])
        return losses

    @torch.no_grad()
    def predict(self, x: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
        """P(agree) for rows x [n, d] -> [n]."""
        return torch.sigmoid(self.net(self._inputs(x)).squeeze(-1)).numpy()

    def predict_one(self, features: Sequence[float]) -> float:
        return float(self.predict([features])[0])

    # --- files -------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        first, last = self.net[0], self.net[2]
        assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
        return {
            "format": FILE_FORMAT, "file_version": FILE_VERSION,
            "schema": self.schema.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "info": {"stage_agreement_rates": self.info.stage_agreement_rates,
                     "stage_forward_costs": self.info.stage_forward_costs,
                     "num_training_rows": self.info.num_training_rows, "evaluation": self.info.evaluation},
            "weights": {"mean": self.mean.tolist(), "std": self.std.tolist(),
                        "w1": first.weight.tolist(), "b1": first.bias.tolist(),
                        "w2": last.weight.tolist(), "b2": last.bias.tolist()},
        }

    def save(self, path: str | Path) -> None:
        """Write atomically (a temp file renamed into place)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            json.dump(self.to_dict(), handle)
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict, expected_stages: Sequence[StageIdentity] | None = None) -> AgreementPredictor:
        if data.get("format") != FILE_FORMAT or data.get("file_version") != FILE_VERSION:
            raise PredictorMismatchError(f"not a {FILE_FORMAT} file of version {FILE_VERSION}")
        schema_data = data["schema"]
        if int(schema_data["version"]) != SCHEMA_VERSION:
            raise PredictorMismatchError(f"the predictor uses feature schema version {schema_data['version']}, this code "
                                         f"computes version {SCHEMA_VERSION}: retrain it (specmesh cascade collect / train)")
        try:
            schema = FeatureSchema.from_dict(schema_data)
        except ValueError as exc:
            raise PredictorMismatchError(str(exc)) from None
        stages = [StageIdentity.from_dict(s) for s in data["stages"]]
        if expected_stages is not None:
            check_stages(stages, expected_stages)
        weights = data["weights"]
        predictor = cls(schema, stages, hidden=len(weights["b1"]))
        first, last = predictor.net[0], predictor.net[2]
        assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
        with torch.no_grad():
            predictor.mean = torch.tensor(weights["mean"], dtype=torch.float64)
            predictor.std = torch.tensor(weights["std"], dtype=torch.float64)
            first.weight.copy_(torch.tensor(weights["w1"], dtype=torch.float64))
            first.bias.copy_(torch.tensor(weights["b1"], dtype=torch.float64))
            last.weight.copy_(torch.tensor(weights["w2"], dtype=torch.float64))
            last.bias.copy_(torch.tensor(weights["b2"], dtype=torch.float64))
        predictor.net.eval()
        info = data.get("info", {})
        predictor.info = PredictorInfo([float(r) for r in info.get("stage_agreement_rates", [])],
                                       [float(c) for c in info.get("stage_forward_costs", [])],
                                       int(info.get("num_training_rows", 0)), dict(info.get("evaluation", {})))
        return predictor

    @classmethod
    def load(cls, path: str | Path, expected_stages: Sequence[StageIdentity] | None = None) -> AgreementPredictor:
        """Read a saved predictor; with `expected_stages`, refuse one trained for other stages."""
        return cls.from_dict(json.loads(Path(path).read_text()), expected_stages)


def _mlp(num_features: int, hidden: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(num_features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)).double()


def check_stages(trained: Sequence[StageIdentity], running: Sequence[StageIdentity]) -> None:
    """Raise PredictorMismatchError unless the stages match in number, order and fingerprint."""
    if [s.fingerprint for s in trained] == [s.fingerprint for s in running]:
        return
    def names(stages: Sequence[StageIdentity]) -> str:
        return " -> ".join(f"{s.name} ({s.fingerprint[:12]})" for s in stages)
    raise PredictorMismatchError(f"the predictor was trained for the stages {names(trained)} but the cascade runs "
                                 f"{names(running)}; collect data and train a predictor for these stages "
                                 "(specmesh cascade collect / train)")
