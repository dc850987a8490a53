"""Saved artifacts: one safetensors file of tensors plus one JSON header, written atomically, never pickled.

``<stem>.safetensors`` and ``<stem>.json`` are written to temporary names and renamed, so an interrupted write
never leaves a half artifact under the real name. Loading checks the header's ``format`` and, when asked, that
its recorded pair and fingerprints match the use (``GeometryMismatchError`` naming both sides otherwise).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cachecert_agents.errors import GeometryMismatchError


def artifact_paths(stem: str | Path) -> tuple[Path, Path]:
    """``(<stem>.safetensors, <stem>.json)``: suffixes are appended, never substituted (model names have dots)."""
    return Path(f"{stem}.safetensors"), Path(f"{stem}.json")


def save_artifact(stem: str | Path, tensors: dict[str, torch.Tensor], header: dict) -> Path:
    """Write ``<stem>.safetensors`` and ``<stem>.json``; returns the safetensors path."""
    st, js = artifact_paths(stem)
    st.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(st) + ".tmp")
    Path(str(js) + ".tmp").write_text(json.dumps(header, indent=1))
    os.replace(str(st) + ".tmp", st)
    os.replace(str(js) + ".tmp", js)
    return st


def load_artifact(stem: str | Path, fmt: str, expect: dict | None = None, what: str = "artifact"
                  ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read an artifact of format ``fmt``; ``expect`` entries must equal the header's."""
    st, js = artifact_paths(stem)
    header = json.loads(js.read_text())
    if header.get("format") != fmt:
        raise ValueError(f"{js}: not a {fmt} file (format {header.get('format')!r})")
    check_header(header, expect, f"{what} {stem}")
    return header, load_file(str(st))


def check_header(header: dict, expect: dict | None, what: str) -> None:
    """Refuse an artifact whose recorded pair/fingerprints differ from ``expect`` (a clear, named error)."""
    for key, value in (expect or {}).items():
        if header.get(key) != value:
            raise GeometryMismatchError(f"{what} was built for {key}={header.get(key)!r}, but this use needs "
                                        f"{key}={value!r}; rebuild it with `cachecert calibrate`")
