"""Means of a SAC run's `train.csv` over windows of episodes: what rl.md quotes from the fine-tuning runs.

    python bench/train_windows.py rl/runs/inss-eight-4-finetune/train.csv --windows 1-60 481-540 541-600

Per window (first-last episode, inclusive): the mean reward (eq. 3) of the actor's sampled decisions, the share of
requests they miss, and the mean reward of the greedy decision at the cluster's own rates (`planning_reward`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def window(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    return int(first), int(last or first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="a train.csv of `tritonctl train --method sac`")
    parser.add_argument("--windows", nargs="+", type=window, required=True, help="episode ranges, e.g. 1-60")
    args = parser.parse_args()
    with open(args.log, newline="") as f:
        rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    print(f"{args.log}: episodes | reward, sampled | requests missed | reward, greedy at the cluster's rates")
    for first, last in args.windows:
        picked = [r for r in rows if first <= r["episode"] <= last]
        if not picked:
            raise SystemExit(f"{args.log}: no episode in {first}-{last}")
        mean = {k: sum(r[k] for r in picked) / len(picked) for k in ("reward", "violation", "planning_reward")}
        print(f"{first}-{last} | {mean['reward']:.2f} | {100 * mean['violation']:.1f}% | {mean['planning_reward']:.2f}")


if __name__ == "__main__":
    main()
