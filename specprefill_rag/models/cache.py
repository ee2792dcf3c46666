"""Where converted and installed models live, and the memo of their verified content digests.

A leaf: the loaders and the named-model store both keep their files here.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models live: ``$SPECPREFILL_CACHE`` or the user cache dir."""
    configured = os.environ.get("SPECPREFILL_CACHE")
    if configured:
        return Path(configured)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("specprefill-rag"))


def _digest_memo() -> tuple[Path, dict[str, str]]:
    memo_path = cache_dir() / "gguf" / "digests.json"
    try:
        return memo_path, json.loads(memo_path.read_text())
    except (OSError, ValueError):
        return memo_path, {}


def _memo_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def remember_digest(path: Path, digest: str) -> None:
    """Record a digest already verified elsewhere (e.g. while assembling the file)."""
    memo_path, memo = _digest_memo()
    memo[_memo_key(path)] = digest
    _write_atomically(memo_path, json.dumps(memo, indent=0))


def content_digest(path: Path) -> str:
    """sha256 of a file's bytes, memoised per (path, size, mtime) in the cache, so a large file is read
    once; the same file installed in two environments has one digest and one converted copy.
    """
    memo = _digest_memo()[1]
    key = _memo_key(path)
    if key not in memo:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
        remember_digest(path, digest.hexdigest())
        return digest.hexdigest()
    return memo[key]


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".writing-", dir=path.parent)
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.replace(staging, path)
