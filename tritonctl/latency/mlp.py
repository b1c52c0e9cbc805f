"""An MLP latency predictor in the spirit of Abacus: which models co-run, their batches and shares in, each one's
batch latency out.

Inputs of a query (model i at batch b and share s beside co-runners J): a one-hot of i; log2 b and i's
effective share; for every model of the profile whether it co-runs, log2 of its batch and its effective share
(zeros when it does not). Output: the log of the batch's median client latency (ms), what `fit` measures.
Two hidden layers of ReLU units (scikit-learn's MLPRegressor, L-BFGS, which scikit-learn advises for small
data), inputs standardised, fitted on the profile's training rows, solo and co-located. A profile holds
hundreds of rows where Abacus trained on thousands, so the L2 penalty is chosen by 3-fold cross-validation on
the training rows, grouped by run (the held-out rows stay unseen), and three networks from different seeds
are averaged (in log latency). The
latency-model file keeps their weights (`LatencyModel.mlp`), so `plan`, `simulate` and `bench` use it through
`LatencyModel.t_inf`.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tritonctl.errors import TritonctlError
from tritonctl.latency.dataset import Dataset, Measurement

MIN_COLOC_ROWS = 20  # co-located training rows below which the MLP is refused
HIDDEN = (64, 64)
PENALTIES = (0.03, 0.1, 0.3, 1.0)  # the L2 penalties cross-validation chooses among
SEEDS = 3  # networks averaged
ABACUS_MEAN_ERROR = 0.055  # the mean error Abacus reports for its MLP

Corunners = tuple[tuple[str, int, int], ...]  # (model, share, batch) beside the one predicted


Layers = tuple[tuple[tuple[tuple[float, ...], ...], tuple[float, ...]], ...]  # (weights, biases) per layer


@dataclass(frozen=True)
class MlpPredictor:
    """A fitted ensemble: the profile's models (the input layout), the standardisation and each network's layers."""

    names: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    networks: tuple[Layers, ...]
    penalty: float  # the L2 penalty cross-validation chose

    def features(self, eff: Callable[[int], float], model: str, batch: int, share: int, corunners: Corunners) -> list:
        return features(self.names, eff, model, batch, share, corunners)

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray, list[list[tuple[np.ndarray, np.ndarray]]]]:
        """The standardisation and the layers as arrays, built once (planning queries the MLP thousands of times)."""
        layers = [[(np.array(w), np.array(b)) for w, b in network] for network in self.networks]
        return np.array(self.mean), np.array(self.scale), layers

    def predict_ms(self, x: np.ndarray) -> np.ndarray:
        """Batch latencies (ms) of feature rows `x`: the networks' mean log latency."""
        mean, scale, networks = self._arrays
        x = (np.atleast_2d(x) - mean) / scale
        logs = []
        for layers in networks:
            h = x
            for k, (w, b) in enumerate(layers):
                h = h @ w + b
                if k < len(layers) - 1:
                    h = np.maximum(h, 0.0)
            logs.append(h[:, 0])
        return np.exp(np.mean(logs, axis=0))

    def to_json(self) -> dict:
        return {"names": self.names, "mean": self.mean, "scale": self.scale, "networks": self.networks,
                "penalty": self.penalty}  # fmt: skip

    @staticmethod
    def from_json(data: dict) -> MlpPredictor:
        networks = tuple(
            tuple((tuple(tuple(row) for row in w), tuple(b)) for w, b in layers) for layers in data["networks"]
        )
        return MlpPredictor(tuple(data["names"]), tuple(data["mean"]), tuple(data["scale"]), networks, data["penalty"])


def features(
    names: tuple[str, ...], eff: Callable[[int], float], model: str, batch: int, share: int, corunners: Corunners
) -> list[float]:
    """The input row of one query (see the module's docstring)."""
    index = {n: k for k, n in enumerate(names)}
    own = [0.0] * len(names)
    own[index[model]] = 1.0
    others = [0.0] * (3 * len(names))
    for name, s, b in corunners:
        k = 3 * index[name]
        others[k : k + 3] = [1.0, math.log2(b), eff(s)]
    return [*own, math.log2(batch), eff(share), *others]


def coloc_rows(rows: list[Measurement]) -> int:
    return sum(r.kind == "coloc" for r in rows)


def fit_mlp(dataset: Dataset, eff: Callable[[int], float], seed: int = 0) -> MlpPredictor:
    """Fit the MLP on the profile's training rows; refused below MIN_COLOC_ROWS co-located ones."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.model_selection import GridSearchCV, GroupKFold
    from sklearn.neural_network import MLPRegressor

    names = tuple(sorted(dataset.models))
    rows = [r for r in dataset.rows if r.split == "train" and r.model in names]
    if coloc_rows(rows) < MIN_COLOC_ROWS:
        raise TritonctlError(
            f"the MLP predictor needs at least {MIN_COLOC_ROWS} co-located training rows and the profile has "
            f"{coloc_rows(rows)}: profile more co-locations (tritonctl profile resumes), or use the InSS model",
            file=dataset.folder / "measurements.csv",
        )
    x = np.array([features(names, eff, r.model, r.batch, r.share, tuple(r.corunner_list())) for r in rows])
    y = np.log([r.p50_ms for r in rows])
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale == 0] = 1.0
    z = (x - mean) / scale

    def net(penalty: float, seed: int) -> MLPRegressor:
        return MLPRegressor(hidden_layer_sizes=HIDDEN, alpha=penalty, solver="lbfgs", max_iter=500, random_state=seed)

    groups = [r.config_id for r in rows]
    search = GridSearchCV(
        net(PENALTIES[0], seed), {"alpha": PENALTIES}, cv=GroupKFold(3), scoring="neg_mean_absolute_error"
    )
    with warnings.catch_warnings():  # a network that stops at max_iter is still a fit
        warnings.simplefilter("ignore", ConvergenceWarning)
        penalty = float(search.fit(z, y, groups=groups).best_params_["alpha"])
        fitted = [net(penalty, seed + k).fit(z, y) for k in range(SEEDS)]
    networks = tuple(
        tuple((tuple(map(tuple, w.tolist())), tuple(b.tolist())) for w, b in zip(f.coefs_, f.intercepts_, strict=True))
        for f in fitted
    )  # fmt: skip
    return MlpPredictor(names, tuple(mean.tolist()), tuple(scale.tolist()), networks, penalty)
