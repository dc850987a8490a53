"""Resolve a model name to transformers objects: embedded GGUF models, local directories, Hugging Face ids.

Embedded models are dequantised from GGUF on first load (tens of seconds) and saved once as a float32
safetensors directory beside the GGUF (``<model dir>/hf``), written to a temporary directory and renamed, so later
loads take seconds and an interrupted conversion is never mistaken for a finished one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cachecert_agents.artifacts import write_atomic
from cachecert_agents.errors import UnknownModelError
from cachecert_agents.models import registry

if TYPE_CHECKING:
    from cachecert_agents.models.geometry import ModelGeometry

logger = logging.getLogger(__name__)

_CONVERTED = "hf"
_MARKER = "cachecert-source.json"


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


def _converted_dir(name: str, gguf: Path) -> Path | None:
    target = gguf.parent / _CONVERTED
    try:
        marker = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return target if marker.get("sha256") == registry.get_spec(name).sha256 else None


def _convert(name: str, gguf: Path, model: Any, tokenizer: Any) -> None:
    """Save a GGUF-loaded model as a float32 safetensors directory, atomically."""
    target = gguf.parent / _CONVERTED
    tmp = gguf.parent / (_CONVERTED + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # transformers refuses save_pretrained on GGUF-loaded models; the weights are plain dequantised float tensors,
    # so save the config (without the GGUF marker) and the state dict directly.
    import copy

    from safetensors.torch import save_model

    tmp.mkdir(parents=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(json.dumps({"name": name, "gguf": gguf.name,
                                           "sha256": registry.get_spec(name).sha256}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    logger.info("saved a converted copy of %s at %s for fast loading", name, target)


def load_pretrained(name_or_path: str, dtype: torch.dtype = torch.float32, convert: bool = True
                    ) -> tuple[Any, Any, str]:
    """Load ``(model, tokenizer, source)`` for an embedded model name, a local directory or a hub id.

    Embedded models must be installed (``cachecert models install NAME``). A local directory may hold a
    transformers checkpoint or a single ``*.gguf`` file. Anything else is tried as a Hugging Face model id
    (which needs the hub or a local Hugging Face cache).
    """
    if name_or_path in registry.EMBEDDED_MODELS:
        gguf = registry.require_installed(name_or_path)
        converted = _converted_dir(name_or_path, gguf)
        if converted is not None:
            model, tokenizer = _from_dir(converted, dtype)
        else:
            logger.info("loading %s from GGUF (dequantising; first load only)", name_or_path)
            model, tokenizer = _from_gguf(gguf.parent, gguf.name, dtype)
            if convert:
                _convert(name_or_path, gguf, model, tokenizer)
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
        cache_file = gguf.parent / "geometry.json"
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
