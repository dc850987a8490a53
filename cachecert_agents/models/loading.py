"""Resolve a model name to transformers objects: embedded GGUF models, local directories, Hugging Face ids.

Embedded models are dequantised from GGUF on first load (tens of seconds) and saved once as a float32
safetensors directory beside the GGUF (``<model dir>/hf``), written to a temporary directory and renamed, so later
loads take seconds and an interrupted conversion is never mistaken for a finished one. The copy is only a speed-up:
one whose marker, dtype or size does not match, or that fails to load, is replaced from the GGUF.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError

from cachecert_agents.artifacts import file_fingerprint, write_atomic
from cachecert_agents.errors import UnknownModelError
from cachecert_agents.models import registry

if TYPE_CHECKING:
    from cachecert_agents.models.geometry import ModelGeometry

logger = logging.getLogger(__name__)

_MARKER = "cachecert-source.json"
_WEIGHTS = "model.safetensors"


def _from_gguf(directory: Path, filename: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype)
    return model, tokenizer


def _from_dir(source: str | Path, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    return model, tokenizer


def _converted_dir(name: str, gguf: Path, verify: bool = False) -> Path | None:
    """The float32 copy of ``gguf`` when its marker names this GGUF (sha256) and its weights file has the size
    recorded there (markers written before sizes were recorded: the file must exist); with ``verify``, also the
    sha256 recorded there (read in full: seconds per GB). None otherwise."""
    target = gguf.parent / registry.CONVERTED_DIR
    try:
        marker = json.loads((target / _MARKER).read_text())
        size = (target / _WEIGHTS).stat().st_size
    except (OSError, ValueError):
        return None
    if marker.get("sha256") != registry.get_spec(name).sha256 or _copy_dtype(target, marker) != "float32":
        return None
    if marker.get("bytes", size) != size:
        return None
    if verify and "weights_sha256" in marker and marker["weights_sha256"] != file_fingerprint(target / _WEIGHTS):
        logger.warning("the converted copy of %s at %s does not match its recorded sha256; it is replaced", name,
                       target)
        return None
    return target


def _copy_dtype(target: Path, marker: dict) -> str | None:
    """The copy's dtype: from its marker, else (markers before dtypes were recorded, when a copy could be saved
    in any dtype) from the safetensors header's first tensor (``F32`` -> ``float32``)."""
    if "dtype" in marker:
        return marker["dtype"]
    try:
        with open(target / _WEIGHTS, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    except (OSError, ValueError):
        return None
    stored = next((v["dtype"] for k, v in header.items() if k != "__metadata__"), None)
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(stored, stored)


def _convert(name: str, gguf: Path, model: Any, tokenizer: Any) -> None:
    """Save a float32 GGUF-loaded model as a safetensors directory, atomically (a temporary directory of its own,
    then renamed). Only a speed-up: a failure (a full disk, say) is logged and the load goes on."""
    import copy
    import tempfile

    from safetensors.torch import save_model

    target = gguf.parent / registry.CONVERTED_DIR
    registry.remove_stale_temporaries(gguf.parent, registry.CONVERTED_DIR + ".tmp*")
    tmp = Path(tempfile.mkdtemp(dir=gguf.parent, prefix=registry.CONVERTED_DIR + ".tmp-"))
    try:
        # transformers refuses save_pretrained on GGUF-loaded models; the weights are plain dequantised float
        # tensors, so save the config (without the GGUF marker) and the state dict directly.
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / _WEIGHTS))
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({"name": name, "gguf": gguf.name, "dtype": "float32",
                                               "sha256": registry.get_spec(name).sha256,
                                               "bytes": (tmp / _WEIGHTS).stat().st_size,
                                               "weights_sha256": file_fingerprint(tmp / _WEIGHTS)}))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except Exception as exc:  # noqa: BLE001 - the copy is optional; the model in memory is fine
        logger.warning("could not save a converted copy of %s (%s: %s); later loads dequantise the GGUF again",
                       name, type(exc).__name__, exc)
        return
    finally:  # also on an interrupt: no half-written copy is left behind (after the rename there is none)
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("saved a converted copy of %s at %s for fast loading", name, target)


def _load_embedded(name: str, dtype: torch.dtype, convert: bool, verify: bool = False) -> tuple[Any, Any]:
    """An installed embedded model: from its converted copy when there is a sound one (``verify``: its sha256
    checked too), else from the GGUF (then saved as a copy when ``convert`` and ``dtype`` is float32, the copy's
    one dtype). A copy that fails to load is removed (logged) and the GGUF is used."""
    gguf = registry.require_installed(name)
    converted = _converted_dir(name, gguf, verify)
    damaged = None
    if converted is not None:
        try:
            return _from_dir(converted, dtype)
        except (OSError, ValueError, SafetensorError) as exc:  # what a damaged copy raises (not MemoryError)
            logger.warning("the converted copy of %s at %s does not load (%s: %s); loading the GGUF and replacing "
                           "the copy", name, converted, type(exc).__name__, str(exc)[:200])
            damaged = converted
    logger.info("loading %s from GGUF (dequantising; first load only)", name)
    model, tokenizer = _from_gguf(gguf.parent, gguf.name, dtype)
    if damaged is not None:  # removed only once the GGUF has loaded
        shutil.rmtree(damaged, ignore_errors=True)
    if convert and dtype == torch.float32:
        _convert(name, gguf, model, tokenizer)
    return model, tokenizer


def load_pretrained(name_or_path: str, dtype: torch.dtype = torch.float32, convert: bool = True,
                    verify: bool = False) -> tuple[Any, Any, str]:
    """Load ``(model, tokenizer, source)`` for an embedded model name, a local directory or a hub id.

    Embedded models must be installed (``cachecert models install NAME``); ``verify`` reads their converted
    copy in full against its recorded sha256 (``models install`` does; a plain load checks marker and size). A local directory may hold a
    transformers checkpoint or a single ``*.gguf`` file. Anything else is tried as a Hugging Face model id
    (which needs the hub or a local Hugging Face cache).
    """
    if name_or_path in registry.EMBEDDED_MODELS:
        model, tokenizer = _load_embedded(name_or_path, dtype, convert, verify)
        return model, tokenizer, f"embedded:{name_or_path}"
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            model, tokenizer = _from_gguf(path, ggufs[0].name, dtype)
        else:
            model, tokenizer = _from_dir(path, dtype)
        return model, tokenizer, f"path:{path.resolve()}"
    if path.suffix == ".gguf" and path.is_file():
        model, tokenizer = _from_gguf(path.parent, path.name, dtype)
        return model, tokenizer, f"path:{path.resolve()}"
    try:
        model, tokenizer = _from_dir(name_or_path, dtype)
    except OSError as exc:
        known = ", ".join(sorted(registry.EMBEDDED_MODELS))
        raise UnknownModelError(
            f"cannot load model {name_or_path!r}: not an embedded model ({known}), not a local directory, and "
            f"not loadable as a Hugging Face id ({exc.__class__.__name__}: {str(exc).splitlines()[0][:200]})"
        ) from exc
    return model, tokenizer, f"hf:{name_or_path}"


def load_config_and_tokenizer(name_or_path: str) -> tuple[Any, Any]:
    """Config and tokenizer without the weights (embedded models must be installed)."""
    from transformers import AutoConfig, AutoTokenizer

    if name_or_path in registry.EMBEDDED_MODELS:
        gguf = registry.require_installed(name_or_path)
        converted = _converted_dir(name_or_path, gguf)
        if converted is not None:
            return AutoConfig.from_pretrained(converted), AutoTokenizer.from_pretrained(converted)
        return (AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name),
                AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    return AutoConfig.from_pretrained(name_or_path), AutoTokenizer.from_pretrained(name_or_path)


def model_geometry(name_or_path: str) -> "ModelGeometry":
    """Geometry of a model without loading its weights; cached beside installed embedded models."""
    from cachecert_agents.models.geometry import ModelGeometry, geometry_from_config

    cache_file = None
    if name_or_path in registry.EMBEDDED_MODELS:
        gguf = registry.require_installed(name_or_path)
        cache_file = gguf.parent / registry.GEOMETRY_CACHE
        try:
            cached = json.loads(cache_file.read_text())
            if cached.get("sha256") == registry.get_spec(name_or_path).sha256:
                return ModelGeometry.model_validate(cached["geometry"])
        except (OSError, ValueError, KeyError):
            pass
    config, tokenizer = load_config_and_tokenizer(name_or_path)
    geometry = geometry_from_config(config, tokenizer)
    if cache_file is not None:
        write_atomic(cache_file, json.dumps({"sha256": registry.get_spec(name_or_path).sha256,
                                             "geometry": geometry.model_dump()}))
    return geometry
