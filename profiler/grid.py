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

Solo, repeated: three held-out configurations of each model measured again after everything
else (`repeat_runs`), so that the report can say how far the machine repeats itself over a
profile's length: no fit can be expected to predict one measurement much closer than that.

Co-located, for fitting (InSS used five sets): every pair at 50/50 with batch 4 each and at
25/75 with batches 2 and 8, and for three or more models every group of three at
25/25/50 with batch 4. Co-located, held out: every pair at 75/25 with batches 8 and 2, and
the first group of three at 50/25/25 with batches 2, 8 and 4. Pairs and triples are capped
(seeded sample) so large clusters stay within budget.

Solo configurations are measured in waves of rising batch size (`in_waves`), and one with no
more share and a larger batch than a configuration of its model already measured slower than
`SLOWER_THAN_SLO` times the model's SLO is not measured at all (`left_out`): it can only be
slower, no plan can use it, and the large batches at small shares are most of a profile's
time. Those a co-located run measures stay: the fit judges their slowdown against them. The
fit keeps the slow configurations that stopped the wave as floors under every configuration
they rule out (model.py).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

TRAIN_SHARES = (0.25, 0.375, 0.5, 0.75, 0.875, 1.0)
TRAIN_BATCHES = (1, 2, 4, 8, 16, 32)
HELDOUT_SHARES = (0.35, 0.6, 0.85)
HELDOUT_BATCHES = (3, 6, 12, 24)
REPEATED = ((0.35, 6), (0.6, 3), (0.85, 6))  # held-out (share, batch) measured again at the end: short runs
MAX_PAIRS = 6
MAX_TRIPLES = 3
SLOWER_THAN_SLO = 2.0  # a solo configuration this many SLOs slow ends its model's larger batches at no more share


@dataclass(frozen=True)
class Member:
    model: str
    share: int  # device units
    batch: int


@dataclass(frozen=True)
class Run:
    """One measurement: a single model (solo) or several at once (coloc), each at share and batch."""

    kind: str  # solo | coloc
    split: str  # train | heldout | repeat
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


def repeat_runs(models: list[str], units: int) -> list[Run]:
    """`REPEATED`'s held-out configurations of every model, to be measured again last."""
    return [
        Run("solo", "repeat", (Member(model, _units(frac, units), batch),))
        for model in models
        for frac, batch in REPEATED
    ]


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


def in_waves(runs: list[Run], seed: int = 0) -> list[Run]:
    """`runs` in a seeded random order, solo ones in waves of rising batch size (co-located ones dealt into the
    waves at random): each configuration's smaller batches are measured before it, and within a wave a transient
    slowdown of the machine spreads over unrelated models and shares (across waves it shifts a range of batch
    sizes: a quiet machine matters)."""
    rng = random.Random(seed)
    shuffled = list(runs)
    rng.shuffle(shuffled)
    batches = sorted({r.members[0].batch for r in runs if r.kind == "solo"})
    rank = {b: i for i, b in enumerate(batches)}
    keys = [rank[r.members[0].batch] if r.kind == "solo" else rng.randrange(len(batches) or 1) for r in shuffled]
    return [run for _, run in sorted(zip(keys, shuffled, strict=True), key=lambda pair: pair[0])]


def beyond(member: Member, slow: list[Member]) -> bool:
    """Whether a solo configuration has no more share and a larger batch than one of `slow` (its model's
    configurations measured slower than `SLOWER_THAN_SLO` SLOs)."""
    return any(s.model == member.model and s.share >= member.share and s.batch < member.batch for s in slow)


def colocated(runs: list[Run]) -> frozenset[Member]:
    """Every configuration a co-located run of `runs` measures."""
    return frozenset(m for r in runs if r.kind == "coloc" for m in r.members)


def left_out(run: Run, slow: list[Member], measured_colocated: frozenset[Member]) -> bool:
    """Whether `run` is a solo configuration beyond one of `slow` that no co-located run measures."""
    return run.kind == "solo" and beyond(run.members[0], slow) and run.members[0] not in measured_colocated
