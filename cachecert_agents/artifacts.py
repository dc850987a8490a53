"""Saved artifacts: one safetensors file of tensors plus one JSON header, written atomically, never pickled.

``<stem>.safetensors`` and ``<stem>.json`` are written to temporary names and renamed, so an interrupted write
never leaves a half artifact under the real name. The header records the sha256 of the tensor file
(``tensors_sha256``), so a header paired with other tensors (a crash between the two renames, a file copied over
by hand) is refused on load. Loading checks the header's ``format`` and, when asked, that its recorded pair and
fingerprints match the use (``GeometryMismatchError`` naming both sides otherwise).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from cachecert_agents.errors import GeometryMismatchError

logger = logging.getLogger(__name__)

#: identity entries an artifact built before they existed may lack: checked when recorded, warned about when not
OPTIONAL_IDENTITY_KEYS = ("sender_weights", "receiver_weights")


def bytes_fingerprint(data: bytes) -> str:
    """sha256 (16 hex) of bytes."""
    return hashlib.sha256(data).hexdigest()[:16]


def json_fingerprint(obj: Any) -> str:
    """sha256 (16 hex) of a JSON-serialisable object, keys sorted (equal objects, equal fingerprints)."""
    return bytes_fingerprint(json.dumps(obj, sort_keys=True).encode())


def file_fingerprint(path: str | Path) -> str:
    """sha256 (16 hex) of a file's bytes (e.g. a mapper's safetensors)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def artifact_paths(stem: str | Path) -> tuple[Path, Path]:
    """``(<stem>.safetensors, <stem>.json)``: suffixes are appended, never substituted (model names have dots)."""
    return Path(f"{stem}.safetensors"), Path(f"{stem}.json")


def read_artifact_header(stem: str | Path) -> dict:
    """The JSON header ``<stem>.json`` alone (no tensors read); ``ValueError`` when it is not a JSON object."""
    js = artifact_paths(stem)[1]
    header = json.loads(js.read_text())
    if not isinstance(header, dict):
        raise ValueError(f"{js}: not an artifact header (a JSON {type(header).__name__}, not an object)")
    return header


def artifact_fingerprint(stem: str | Path) -> str:
    """The sha256 (16 hex) of an artifact's tensor file: as its header records it, else computed."""
    return read_artifact_header(stem).get("tensors_sha256") or file_fingerprint(artifact_paths(stem)[0])


def keep_aside(path: str | Path) -> Path | None:
    """Rename an existing file to ``<name>.replaced-<unix time>`` (logged) before something new takes its
    name, so nothing a user built is silently overwritten; returns the new path (None when there was no file)."""
    path = Path(path)
    if not path.exists():
        return None
    aside = path.with_name(f"{path.name}.replaced-{int(time.time())}")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.replaced-{int(time.time())}-{n}"), n + 1
    path.rename(aside)
    logger.warning("kept the earlier %s aside as %s", path, aside)
    return aside


def keep_artifact_aside(stem: str | Path) -> None:
    """:func:`keep_aside` both files of an artifact."""
    for path in artifact_paths(stem):
        keep_aside(path)


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` to ``path`` through a uniquely named temporary file in the same directory, fsynced before it
    is renamed over ``path``: a crash leaves the old file or the new one, never a half-written or empty one, and
    concurrent writers (threads or processes) never share a temporary file. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_artifact(stem: str | Path, tensors: dict[str, torch.Tensor], header: dict) -> Path:
    """Write ``<stem>.safetensors`` and ``<stem>.json`` (the header plus ``tensors_sha256``), each with
    :func:`write_atomic`; returns the safetensors path."""
    st, js = artifact_paths(stem)
    data = save_bytes({k: v.contiguous() for k, v in tensors.items()})
    write_atomic(st, data)
    write_atomic(js, json.dumps(dict(header, tensors_sha256=bytes_fingerprint(data)), indent=1))
    return st


def load_artifact(stem: str | Path, fmt: str, expect: dict | None = None, what: str = "artifact"
                  ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read an artifact of format ``fmt``; ``expect`` entries must equal the header's."""
    st, js = artifact_paths(stem)
    header = read_artifact_header(stem)
    if header.get("format") != fmt:
        raise ValueError(f"{js}: not a {fmt} file (format {header.get('format')!r})")
    check_header(header, expect, f"{what} {stem}")
    data = st.read_bytes()  # read once: hashed and parsed from the same bytes
    recorded, found = header.get("tensors_sha256"), bytes_fingerprint(data)
    if recorded is not None and found != recorded:
        raise ValueError(f"{st} does not match its header {js} (tensors sha256 {found}, header records "
                         f"{recorded}): the pair was not written together; rebuild the {what}")
    return header, load_bytes(data)


def check_header(header: dict, expect: dict | None, what: str) -> None:
    """Refuse an artifact whose recorded pair/fingerprints differ from ``expect`` (a clear, named error). An
    :data:`OPTIONAL_IDENTITY_KEYS` entry the artifact does not record (built by an earlier version) is warned
    about, not refused: its geometry and tokenizer fingerprints are still checked."""
    mismatch = first_identity_mismatch(header, expect, what)
    if mismatch is not None:
        key, value = mismatch
        raise GeometryMismatchError(f"{what} was built for {key}={header.get(key)!r}, but this use needs "
                                    f"{key}={value!r}; rebuild it with `cachecert calibrate`")


def first_identity_mismatch(recorded: dict, expect: dict | None, what: str) -> tuple[str, object] | None:
    """The first ``(key, expected value)`` of ``expect`` that ``recorded`` contradicts, or None. An
    :data:`OPTIONAL_IDENTITY_KEYS` entry ``recorded`` lacks is warned about (``what`` names the artifact) and
    passes."""
    for key, value in (expect or {}).items():
        if key in OPTIONAL_IDENTITY_KEYS and key not in recorded:
            logger.warning("%s records no %s (built by an earlier version): the models' weights are not checked, "
                           "only their geometry and tokenizer; rebuild it to check them", what, key)
            continue
        if recorded.get(key) != value:
            return key, value
    return None
