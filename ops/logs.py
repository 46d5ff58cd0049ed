"""Structured logs for the services: one line per event as `key=value` pairs, or JSON lines
with `--log-json`, always with time, level and component."""

from __future__ import annotations

import json
import logging
import sys
import time


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return (
            f"{stamp}.{int(record.msecs):03d}Z level={record.levelname} "
            f'component={record.name} msg="{record.getMessage()}"'
        )


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "time": record.created,
                "level": record.levelname,
                "component": record.name,
                "message": record.getMessage(),
            }
        )


def configure_logging(json_lines: bool = False, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_lines else _KeyValueFormatter())
    root = logging.getLogger("fedsilo")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
