"""Writes silo/datasets/blood_pressure/blood_pressure.csv: a synthetic regression table of three
clinics, no download.

Every value is drawn from a NumPy generator seeded with SEED, so running this script again
writes the same file byte for byte (`python examples/datasets/make_blood_pressure.py [OUT]` from
the repository's root; tests/test_regression.py checks it). Nothing here is real patient data;
the coefficients below are made up to give a learnable, noisy linear target.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

SEED = 20240611
CLINICS = {"north": (200, 0.0), "river": (160, 4.0), "hill": (140, -3.0)}  # rows, offset
OUT = Path(__file__).parents[2] / "silo" / "datasets" / "blood_pressure" / "blood_pressure.csv"
COLUMNS = ("clinic", "age", "bmi", "smoker", "sodium_g", "systolic")


def rows(rng: np.random.Generator) -> list[tuple[object, ...]]:
    """Each clinic's patients: age, BMI, smoker, daily sodium (g) and systolic pressure."""
    table: list[tuple[object, ...]] = []
    for clinic, (n, offset) in CLINICS.items():
        age = rng.integers(25, 85, size=n)
        bmi = rng.normal(27.0, 4.5, size=n).clip(16.0, 48.0)
        smoker = rng.random(n) < 0.25
        sodium = rng.gamma(6.0, 0.6, size=n)
        systolic = (
            95.0
            + 0.55 * age
            + 0.9 * bmi
            + 6.0 * smoker
            + 2.2 * sodium
            + offset
            + rng.normal(0.0, 7.0, size=n)
        )
        for i in range(n):
            table.append(
                (
                    clinic,
                    int(age[i]),
                    round(float(bmi[i]), 1),
                    "yes" if smoker[i] else "no",
                    round(float(sodium[i]), 2),
                    round(float(systolic[i]), 1),
                )
            )
    return table


def main(out: Path = OUT) -> None:
    with out.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows(rows(np.random.default_rng(SEED)))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
