"""Data loaders of the entry point group `fedsilo.datasets`: an image set that needs no download.

A loader is called as `loader(**args)` with the data section's `args`, at each site, on that
site's own data, and returns a `PluginData` (arrays: `x` of shape (n, *input_shape), `y` of
shape (n,)) or a `PluginDataset` (a torch Dataset of (x, y) pairs). A hospital's loader reads
its own files here (a path in `args`, or in the site's silo.yaml).
"""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits

from fedsilo.silo.data.plugins import PluginData

CLASSES = 10


def digits_16x16(rows: int | None = None) -> PluginData:
    """scikit-learn's bundled 8x8 handwritten digits, each pixel repeated 2x2 into a 16x16
    image in [0, 1]: `x` of shape (n, 1, 16, 16), `y` the digit; the first `rows` images, or
    all 1797."""
    digits = load_digits()
    images = digits.images[:rows] / 16.0  # (n, 8, 8), pixel values 0..16
    upsampled = images.repeat(2, axis=1).repeat(2, axis=2)[:, np.newaxis]
    return PluginData(
        x=upsampled.astype(np.float32),
        y=digits.target[:rows].astype(np.int64),
        task="classification",
        num_classes=CLASSES,
    )
