"""Append-only JSONL files that survive crashes: each record is one line, written and fsynced at once.

A crash can cut only the line being written; readers skip a cut line and writers start a new line after it, so
earlier records are never lost or corrupted.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line cut by a crash: everything before it is intact
                logger.warning("%s: skipping a truncated line", path)
    return records


def append_jsonl(path: Path, record: dict) -> None:
    """Append one record and fsync; a line left unterminated by a crash is closed first, not extended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    needs_newline = False
    if path.exists() and path.stat().st_size:
        with path.open("rb") as fh:
            fh.seek(-1, os.SEEK_END)
            needs_newline = fh.read(1) != b"\n"
    with path.open("a") as fh:
        fh.write(("\n" if needs_newline else "") + json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
