"""A silo's data: source readers, encoding, the consortium's silos (natural or simulated
partitions), each silo's splits, local scaling, label noise and pooling.

`load_consortium` (consortium.py) turns the policy's `data:` section into one `SiloDataset` per
silo:

  source -> raw table -> validation -> silos -> per silo: split, preprocess, label noise

Only facts of the schema cross silos: the columns, the fixed category lists of the data
dictionary, the missing-value markers and the label set. Every statistic (medians, means,
standard deviations) is fitted on a silo's own training rows and applied to its own
validation and test rows, as it would be at a real, separate site. With `data.scaling:
federated` the silo imputes here but leaves standardisation to the consortium's scaler
(silo/tasks/scaling.py), which is built from summed moments only.

All randomness comes from `np.random.SeedSequence([seed, purpose, ...])` (seeds.py), one purpose
per use, so a seed reproduces a consortium exactly and the uses do not disturb one another.
"""

from fedsilo.silo.data.consortium import load_consortium
from fedsilo.silo.data.dataset import SiloDataset
from fedsilo.silo.data.pooling import pool
from fedsilo.silo.errors import DataError

__all__ = ["DataError", "SiloDataset", "load_consortium", "pool"]
