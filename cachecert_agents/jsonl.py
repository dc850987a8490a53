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
    """Every intact record (a JSON object per line) of ``path``; [] when it does not exist. A line that is cut
    (a crash while writing), not UTF-8, not JSON, or JSON but not an object is skipped with a warning naming it:
    one bad line never hides the records around it."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is a ValueError too; a cut line: everything before it is intact
            logger.warning("%s: skipping line %d (cut or not JSON)", path, number)
            continue
        if not isinstance(record, dict):
            logger.warning("%s: skipping line %d (a JSON %s, not a record)", path, number, type(record).__name__)
            continue
        records.append(record)
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
