"""Which configurations a profile measures (pure functions).

Solo, for fitting: 6 shares x 6 batch sizes. The shares are InSS's four quarter steps
plus 37.5% and 87.5%: on a CPU a share is served by a whole number of onnxruntime threads
(one below 1.5 cores of share, two from there on this 2-core machine), and the latency
surface bends inside each regime (a thread throttled mid-operator stalls its sibling), so
each regime gets three levels: 0.5, 0.75, 1 core and 1.5, 1.75, 2 cores. (A first profile
with the four InSS levels alone missed held-out points between 1.5 and 2 cores clearly.)
Batches run 1 to 32 in powers of two: BDA searches batches 1..32, so the fit covers that
whole range instead of extrapolating, and latency is close to piecewise linear in
log-batch.

Solo, held out: off-grid batches (3, 6, 12, 24) x off-grid shares (35%, 60%, 85%),
measured but never fitted, to judge interpolation honestly.

Co-located, for fitting (InSS used five sets): every pair at 50/50 with batch 4 each and at
25/75 with batches 2 and 8, and for three or more models every group of three at
25/25/50 with batch 4. Co-located, held out: every pair at 75/25 with batches 8 and 2, and
the first group of three at 50/25/25 with batches 2, 8 and 4. Pairs and triples are capped
(seeded sample) so large clusters stay within budget.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

TRAIN_SHARES = (0.25, 0.375, 0.5, 0.75, 0.875, 1.0)
TRAIN_BATCHES = (1, 2, 4, 8, 16, 32)
HELDOUT_SHARES = (0.35, 0.6, 0.85)
HELDOUT_BATCHES = (3, 6, 12, 24)
MAX_PAIRS = 6
MAX_TRIPLES = 3


@dataclass(frozen=True)
class Member:
    model: str
    share: int  # device units
    batch: int


@dataclass(frozen=True)
class Run:
    """One measurement: a single model (solo) or several at once (coloc), each at share and batch."""

    kind: str  # solo | coloc
    split: str  # train | heldout
    members: tuple[Member, ...]

    @property
    def group(self) -> str:
        body = "+".join(f"{m.model}:{m.share}:{m.batch}" for m in self.members)
        return f"{self.kind}/{self.split}/{body}"


def _units(frac: float, units: int) -> int:
    return max(1, round(frac * units))


def solo_runs(models: list[str], units: int) -> list[Run]:
    runs = []
    for model in models:
        for frac, batch in itertools.product(TRAIN_SHARES, TRAIN_BATCHES):
            runs.append(Run("solo", "train", (Member(model, _units(frac, units), batch),)))
        for frac, batch in itertools.product(HELDOUT_SHARES, HELDOUT_BATCHES):
            runs.append(Run("solo", "heldout", (Member(model, _units(frac, units), batch),)))
    return runs


def coloc_runs(
    models: list[str], units: int, seed: int = 0, max_pairs: int = MAX_PAIRS, max_triples: int = MAX_TRIPLES
) -> list[Run]:
    rng = random.Random(seed)
    pairs = list(itertools.combinations(models, 2))
    triples = list(itertools.combinations(models, 3))
    if len(pairs) > max_pairs:
        pairs = sorted(rng.sample(pairs, max_pairs))
    if len(triples) > max_triples:
        triples = sorted(rng.sample(triples, max_triples))
    q, h, tq = _units(0.25, units), _units(0.5, units), _units(0.75, units)
    runs = []
    for a, b in pairs:
        runs.append(Run("coloc", "train", (Member(a, h, 4), Member(b, h, 4))))
        runs.append(Run("coloc", "train", (Member(a, q, 2), Member(b, tq, 8))))
    for a, b, c in triples:
        runs.append(Run("coloc", "train", (Member(a, q, 4), Member(b, q, 4), Member(c, h, 4))))
    for a, b in pairs:
        runs.append(Run("coloc", "heldout", (Member(a, tq, 8), Member(b, q, 2))))
    for a, b, c in triples[:1]:
        runs.append(Run("coloc", "heldout", (Member(a, h, 2), Member(b, q, 8), Member(c, q, 4))))
    return runs
