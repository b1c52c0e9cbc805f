"""Locally weighted regression (Cleveland 1979), as a scikit-learn estimator.

Each prediction fits a weighted linear or quadratic model to the training points, weighted
by a Gaussian kernel of their distance to the query (features standardised by their
training range). With `log_target` the fit is done on log(y), which suits latencies: they
scale multiplicatively with batch size and inversely with the resource share.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data


class LocallyWeightedRegression(RegressorMixin, BaseEstimator):
    """Locally weighted linear regression.

    Parameters
    ----------
    bandwidth : float
        Kernel width in units of each feature's training range (0.3 = 30% of the range).
    log_target : bool
        Fit log(y) and return exp of the local prediction; y must then be positive.
    ridge : float
        Tikhonov term that keeps a local fit solvable where few points carry weight.
    degree : int
        1: a local plane; 2: a local quadratic (squares and pairwise products of the features too), which
        follows a surface that bends inside the kernel, as latency does across log batch.
    """

    def __init__(self, bandwidth: float = 0.3, log_target: bool = True, ridge: float = 1e-6, degree: int = 1):
        self.bandwidth = bandwidth
        self.log_target = log_target
        self.ridge = ridge
        self.degree = degree

    def _design(self, Z: np.ndarray) -> np.ndarray:
        """The local model's terms of standardised features `Z` (n, d): 1, z, and for degree 2 z_i * z_j."""
        columns = [np.ones((len(Z), 1)), Z]
        if self.degree == 2:
            i, j = np.triu_indices(Z.shape[1])
            columns.append(Z[:, i] * Z[:, j])
        return np.hstack(columns)

    def fit(self, X, y):
        X, y = validate_data(self, X, y, y_numeric=True)
        if self.bandwidth <= 0:
            raise ValueError(f"bandwidth must be positive, got {self.bandwidth}")
        if self.degree not in (1, 2):
            raise ValueError(f"degree must be 1 or 2, got {self.degree}")
        terms = self._design(X[:1]).shape[1]
        if X.shape[0] < terms:
            raise ValueError(f"n_samples = {X.shape[0]} is too few: a local fit of degree {self.degree} needs {terms}")
        if self.log_target and np.any(y <= 0):
            raise ValueError("log_target needs positive targets")
        self.low_ = X.min(axis=0)
        self.span_ = np.where(np.ptp(X, axis=0) > 0, np.ptp(X, axis=0), 1.0)
        self.X_ = (X - self.low_) / self.span_
        self.y_ = np.log(y) if self.log_target else y.astype(float)
        return self

    def predict(self, X):
        check_is_fitted(self, "X_")
        X = validate_data(self, X, reset=False)
        Q = (X - self.low_) / self.span_
        design = self._design(self.X_)  # (n, terms)
        d2 = ((Q[:, None, :] - self.X_[None, :, :]) ** 2).sum(axis=2)  # (q, n)
        w = np.exp(-d2 / (2 * self.bandwidth**2))
        gram = np.einsum("qn,ni,nj->qij", w, design, design) + self.ridge * np.eye(design.shape[1])
        rhs = np.einsum("qn,ni,n->qi", w, design, self.y_)
        beta = np.linalg.solve(gram, rhs[..., None])[..., 0]  # (q, terms)
        local = np.einsum("qi,qi->q", beta, self._design(Q))
        return np.exp(local) if self.log_target else local
