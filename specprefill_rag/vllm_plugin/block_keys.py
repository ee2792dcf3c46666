"""Prefix caching by ids AND positions: the original positions of a block's tokens join its hash.

vLLM's block hash is ``hash(parent hash, block token ids, extra keys)``; the extra keys come from
``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys(request, start, end, mm_index)`` (LoRA,
multimodal, prompt embeds, the request's ``cache_salt`` on block 0), which the engine core's block
hasher (``get_request_block_hasher``, the scheduler's, shared by Model Runner V1 and V2) looks up as a
module global at call time. The wrapper here appends, for a SpecPrefill request, the original positions
of the block's tokens (:meth:`specprefill_rag.positions.BlockPositions.key`), and nothing where they
equal the indices. So:

- a compressed request's blocks are shared exactly with requests whose ids and positions agree (turn
  ``t+1`` of a conversation whose sparse prompt extends turn ``t``'s hits turn ``t``'s blocks);
- its leading blocks that kept every token (instructions) hash as an ordinary request's do;
- the same ids at other positions never share (vLLM chains hashes: after the first differing block,
  every later block differs);
- a user's own ``cache_salt`` still separates what vLLM separates (its key is kept, ours added): the
  gateway's per-tenant salt stays in block 0's keys, so tenants never share blocks.

Installed by the plugin's ``register()``, after a guard checks that this vLLM has the function with
the expected parameters and that its block hasher looks the name up at call time; when the guard fails
nothing is installed, the probe answer does not advertise :data:`~specprefill_rag.positions.POSITION_KEYED_BLOCKS`,
and clients go on sending a whole-request ``cache_salt``. :func:`remove_position_keyed_blocks` (or
leaving :func:`position_keyed_blocks`) restores vLLM's function exactly. The modules that imported the
function by name for KV-cache events (block pool, simple KV offload) are rebound too, so the events'
extra keys match the hashes.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import InvalidRequestError
from ..positions import BLOCK_KEY_TAG, PROMPT_LENGTH_KEY, RUNS_KEY, BlockPositions

logger = logging.getLogger(__name__)

_HOME = "vllm.v1.core.kv_cache_utils"
_NAME = "generate_block_hash_extra_keys"
# modules that bind the function by name (``from kv_cache_utils import ...``), for KV-cache events' extra keys
_IMPORTERS = ("vllm.v1.core.block_pool", "vllm.v1.simple_kv_offload.manager")
_PARAMETERS = ["request", "start_token_idx", "end_token_idx"]
_ORIGINAL = "__specprefill_original__"
_CACHED = "_specprefill_block_positions"  # attribute of vLLM's Request: parsed once per request
_NOT_SPEC = object()


class _Unparsed:
    """Arguments that do not parse (admission refuses them first): every block keyed by their digest."""

    def __init__(self, args: dict[str, Any]) -> None:
        raw = f"{args.get(PROMPT_LENGTH_KEY)!r}:{args.get(RUNS_KEY)!r}"
        self._key = ("unparsed", hashlib.sha256(raw.encode()).hexdigest())

    def key(self, start: int, end: int) -> tuple[str, ...]:
        return self._key


def request_block_positions(request: Any) -> BlockPositions | _Unparsed | None:
    """The request's parsed positions (cached on the request), or None for a request without them."""
    cached = getattr(request, _CACHED, None)
    if cached is None:
        params = getattr(request, "sampling_params", None)
        args = getattr(params, "extra_args", None) or {}
        cached = _NOT_SPEC
        if isinstance(args, dict) and (PROMPT_LENGTH_KEY in args or RUNS_KEY in args):
            try:
                cached = BlockPositions(int(args[PROMPT_LENGTH_KEY]), args[RUNS_KEY])
            except (InvalidRequestError, KeyError, TypeError, ValueError):
                cached = _Unparsed(args)
        setattr(request, _CACHED, cached)
    return cached if isinstance(cached, BlockPositions | _Unparsed) else None


def _make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def generate_block_hash_extra_keys(
        request: Any, start_token_idx: int, end_token_idx: int, *args: Any, **kwargs: Any
    ) -> Any:
        extra_keys, next_index = original(request, start_token_idx, end_token_idx, *args, **kwargs)
        positions = request_block_positions(request)
        ours = positions.key(start_token_idx, end_token_idx) if positions is not None else None
        if ours is None:
            return extra_keys, next_index
        return (*(extra_keys or ()), (BLOCK_KEY_TAG, ours)), next_index

    setattr(generate_block_hash_extra_keys, _ORIGINAL, original)
    return generate_block_hash_extra_keys


def _home() -> Any:
    import vllm.v1.core.kv_cache_utils  # noqa: F401  (imported for sys.modules)

    return sys.modules[_HOME]


def _looked_up_at_call_time(module: Any) -> bool:
    """Whether the block hasher's code reads the function as a global (not a bound default or closure)."""
    hasher = getattr(module, "get_request_block_hasher", None)
    code = getattr(hasher, "__code__", None)
    stack = [code] if code is not None else []
    while stack:
        current = stack.pop()
        if _NAME in current.co_names:
            return True
        stack += [const for const in current.co_consts if inspect.iscode(const)]
    return False


def _guard(module: Any) -> str | None:
    """Why the wrapper cannot be installed on this vLLM, or None."""
    function = getattr(module, _NAME, None)
    if not callable(function):
        return f"{_HOME}.{_NAME} is absent"
    function = getattr(function, _ORIGINAL, function)
    try:
        names = list(inspect.signature(function).parameters)[: len(_PARAMETERS)]
    except (TypeError, ValueError):
        names = []
    if names != _PARAMETERS:
        return f"{_HOME}.{_NAME} takes {names}, not {_PARAMETERS}"
    if not _looked_up_at_call_time(module):
        return f"{_HOME}.get_request_block_hasher does not look {_NAME} up at call time"
    return None


def install_position_keyed_blocks() -> bool:
    """Wrap vLLM's per-block extra keys (idempotent); False, with a warning, when the guard refuses."""
    module = _home()
    problem = _guard(module)
    if problem is not None:
        logger.warning(
            "specprefill-rag: prefix-cache blocks are not keyed by position (%s); clients send a cache_salt instead",
            problem,
        )
        return False
    current = getattr(module, _NAME)
    wrapper = current if hasattr(current, _ORIGINAL) else _make_wrapper(current)
    original = getattr(wrapper, _ORIGINAL)
    import vllm.v1.core.block_pool  # noqa: F401  (loaded with the scheduler anyway; rebound below)

    for name in (_HOME, *_IMPORTERS):
        importer = sys.modules.get(name)
        if importer is not None and getattr(importer, _NAME, None) is original:
            setattr(importer, _NAME, wrapper)
    return True


def remove_position_keyed_blocks() -> None:
    """Put vLLM's own function back wherever the wrapper was bound (no-op when not installed)."""
    wrapper = getattr(sys.modules.get(_HOME), _NAME, None)
    original = getattr(wrapper, _ORIGINAL, None)
    if original is None:
        return
    for name in (_HOME, *_IMPORTERS):
        importer = sys.modules.get(name)
        if importer is not None and getattr(importer, _NAME, None) is wrapper:
            setattr(importer, _NAME, original)


def position_keyed_blocks_installed() -> bool:
    """Whether vLLM's block hashes cover positions in this process (what the probe answer advertises)."""
    module = sys.modules.get(_HOME)
    return module is not None and hasattr(getattr(module, _NAME, None), _ORIGINAL)


@contextmanager
def position_keyed_blocks() -> Iterator[bool]:
    """Install for the duration of a ``with`` block (yields what :func:`install_position_keyed_blocks`
    returned); leaves the state as it found it: removed only if it was not installed before.
    """
    before = position_keyed_blocks_installed()
    installed = install_position_keyed_blocks()
    try:
        yield installed
    finally:
        if not before:
            remove_position_keyed_blocks()
