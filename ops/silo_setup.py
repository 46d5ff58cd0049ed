"""`fedsilo silo init`: a site's silo.yaml and a systemd unit, written by its IT team.

The configuration is validated exactly as `fedsilo silo start` will read it, and the data it
points at is loaded once, so a mistake (a missing file, a missing option, a bad column) is
reported now, naming the option, not when the consortium starts.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from fedsilo.ops.provision import load_silo_kit
from fedsilo.policies.data import FILE_SOURCES
from fedsilo.silo.config import parse_silo_config
from fedsilo.silo.data import DataError

UNIT = """[Unit]
Description=fedsilo silo agent ({name})
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart={fedsilo} silo start --config {config}
WorkingDirectory={folder}
Restart=on-failure
RestartSec=10
KillSignal=SIGTERM
NoNewPrivileges=true
PrivateTmp=true

[Install]
WantedBy=multi-user.target
"""


def write_silo_config(
    kit_dir: Path,
    out: Path,
    source: str,
    data_path: Path | None,
    target: str | None,
    select: str | None,
    device: str | None,
    metrics_port: int | None,
    rules: Mapping[str, Any],
) -> list[Path]:
    """Write silo.yaml (at `out`) and fedsilo-silo-<name>.service beside it; return both paths.
    `rules`: the site's local rules (silo/config.py `LocalRules`) that differ from the defaults."""
    kit = load_silo_kit(kit_dir)
    out = out.resolve()
    data: dict = {"source": {"source": source}}
    if data_path is not None:
        if not data_path.is_file():
            raise DataError(f"--data {data_path}: file not found")
        data["source"]["path"] = str(data_path.resolve())
    elif source in FILE_SOURCES:
        raise DataError(f"--data: a {source} source needs the data file (--data FILE)")
    if source in FILE_SOURCES and select is None:  # a site's own file is one silo
        data["source"]["partition"] = {"kind": "iid", "silos": 1}
    if target is not None:
        data["source"]["target"] = target
    if select is not None:
        data["select"] = select
    document: dict = {"version": 1, "kit": str(kit.folder.resolve()), "data": data}
    if device is not None:
        document["compute"] = {"device": device}
    if metrics_port is not None:
        document["metrics_port"] = metrics_port
    if rules:
        document["rules"] = dict(rules)
    config = parse_silo_config(document, "silo init")
    config.data.load(seed=0, base_dir=None)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(document, sort_keys=False))
    unit = out.with_name(f"fedsilo-silo-{kit.name}.service")
    executable = shutil.which("fedsilo") or f"{sys.executable} -m fedsilo"
    unit.write_text(UNIT.format(name=kit.name, fedsilo=executable, config=out, folder=out.parent))
    return [out, unit]
