"""Writes silo/datasets/flamby_heart/heart.csv: FLamby's Fed-Heart-Disease table made from the
bundled (corrected) UCI heart table, for policies/examples/flamby-heart-fedavg.yaml.

FLamby's rule (flamby/datasets/fed_heart_disease/dataset.py), applied here:
  * per center, the UCI columns slope, ca and thal are dropped, then every row missing a value
    (UCI's "?", a blank cell here) is dropped; a recorded 0 (Switzerland's chol) is a value;
  * the label is num > 0;
  * each center's rows, in file order, are split by scikit-learn's
    `train_test_split(train_size=0.66, test_size=0.34, random_state=43, shuffle=True)` of the
    row positions, stratified by the label when both classes have more than 2 rows;
  * cp and restecg are one-hot coded with the first code dropped (pandas' get_dummies
    drop_first over all centers: cp 2, 3, 4 and restecg 1, 2), after the other columns;
    sex, fbs and exang are 0/1 and the rest as recorded: 13 features.
Expected train/test: Cleveland 199/104, Hungary 172/89, Switzerland 30/16, VA Long Beach 85/45.
The columns `center` and `split` are the natural silo and the predefined split.

Run from the repository root: `python -m bench.flamby_heart_data`.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split

SOURCE = files("fedsilo.silo") / "datasets/heart/heart_disease_uci.csv"
OUTPUT = Path(__file__).resolve().parents[1] / "silo/datasets/flamby_heart/heart.csv"
CENTERS = ("Cleveland", "Hungary", "Switzerland", "VA Long Beach")  # FLamby's centers 0..3
KEPT = ("age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalch", "exang", "oldpeak")
CODES = {  # UCI's numeric codes for the compilation's words
    "sex": {"Female": 0, "Male": 1},
    "cp": {"typical angina": 1, "atypical angina": 2, "non-anginal": 3, "asymptomatic": 4},
    "restecg": {"normal": 0, "st-t abnormality": 1, "lv hypertrophy": 2},
    "fbs": {False: 0, True: 1},
    "exang": {False: 0, True: 1},
}
TRAIN_FRACTION = 0.66
SPLIT_SEED = 43


def center_rows(table: pd.DataFrame, center: str) -> pd.DataFrame:
    """One center's rows as FLamby keeps them: its columns without slope, ca and thal, rows
    with a missing value dropped, label num > 0, and each row's split."""
    rows = table[table["dataset"] == center]
    rows = rows[[*KEPT, "num"]].dropna().reset_index(drop=True)
    rows = rows.assign(**{column: rows[column].map(codes) for column, codes in CODES.items()})
    label = (rows["num"] > 0).astype(int)
    counts = label.value_counts()
    stratify = label if len(counts) > 1 and (counts > 2).all() else None
    _, test = train_test_split(
        np.arange(len(rows)),
        test_size=1.0 - TRAIN_FRACTION,
        train_size=TRAIN_FRACTION,
        random_state=SPLIT_SEED,
        shuffle=True,
        stratify=stratify,
    )
    split = np.where(np.isin(np.arange(len(rows)), test), "test", "train")
    return rows.drop(columns="num").assign(target=label, center=center, split=split)


def flamby_heart() -> pd.DataFrame:
    with SOURCE.open("rb") as handle:
        table = pd.read_csv(handle)
    rows = pd.concat([center_rows(table, center) for center in CENTERS], ignore_index=True)
    coded = pd.get_dummies(rows, columns=["cp", "restecg"], drop_first=True, dtype=int)
    features = [column for column in coded.columns if column not in ("target", "center", "split")]
    return coded[["center", "split", *features, "target"]]


def main() -> None:
    frame = flamby_heart()
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(OUTPUT, index=False)
    sizes = frame.groupby(["center", "split"], sort=False).size().unstack()
    print(f"wrote {OUTPUT}: {len(frame)} rows, train/test per center:\n{sizes}")


if __name__ == "__main__":
    main()
