"""The runner convention shared by benchmarks: machine facts, model sizes and writing JSON + PNG
results."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import matplotlib
import psutil

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from fedsilo import __version__  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    return {
        "fedsilo": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def count_parameters(model: torch.nn.Module) -> int:
    """Total number of scalar parameters in `model`."""
    return sum(parameter.numel() for parameter in model.parameters())


def write(name: str, document: dict[str, Any], figure: plt.Figure) -> Path:
    """bench/results/<name>.json and <name>.png, side by side."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **document}, indent=2))
    figure.tight_layout()
    figure.savefig(RESULTS / f"{name}.png", dpi=120)
    plt.close(figure)
    return path
