"""Admission: refuse a SpecPrefill request whose generated tokens would pass the model's last position.

Generated tokens get RoPE positions ``L, L+1, ...`` while vLLM's own length check sees only the
compact prompt of ``K`` tokens, so ``L + max_tokens > max_model_len`` must be refused here. The
logits-processor hook of :mod:`.validation` has no model config; ``InputProcessor._validate_params``
(front-end process, every request, before anything reaches the engine core) has both the request's
``SamplingParams`` and ``self.model_config``. The wrapper below runs vLLM's checks first, then this
one, and raises its ``ValueError`` as vLLM's ``VLLMValidationError`` (as vLLM converts those of
logits processors): an HTTP 400 on the OpenAI server (a plain ``ValueError`` there is a 500) and an
exception from ``LLM.generate``. Installed by the plugin's ``register()``, removed by
:func:`remove_length_check`.
"""

from __future__ import annotations

from typing import Any

from ..positions import PROMPT_LENGTH_KEY, RUNS_KEY
from .patching import is_wrapped, restore_method, wrap_method

_ORIGINAL = "_specprefill_original_validate_params"


def check_length(extra_args: dict[str, Any] | None, max_tokens: int | None, max_model_len: int) -> None:
    """Raise ``ValueError`` if a SpecPrefill request would generate past ``max_model_len``.

    ``max_tokens=None`` means vLLM's default, ``max_model_len - K``. Requests without SpecPrefill
    arguments, and malformed ones (refused by :mod:`.validation`), pass.
    """
    args = extra_args or {}
    length, runs = args.get(PROMPT_LENGTH_KEY), args.get(RUNS_KEY)
    if not isinstance(length, int) or not isinstance(runs, list | tuple):
        return
    if max_tokens is None and all(isinstance(n, int) for n in runs[1::2]):
        max_tokens = max_model_len - sum(runs[1::2])
    if max_tokens is not None and length + max_tokens > max_model_len:
        raise ValueError(
            f"SpecPrefill request: original prompt length L={length} + max_tokens={max_tokens} = "
            f"{length + max_tokens} exceeds max_model_len={max_model_len} (generated tokens take positions "
            f"L, L+1, ...); lower max_tokens to at most {max(max_model_len - length, 0)} or send fewer documents"
        )


def _input_processor() -> type:
    from vllm.v1.engine.input_processor import InputProcessor

    if not callable(getattr(InputProcessor, "_validate_params", None)):
        raise RuntimeError(
            "specprefill-rag's length check needs vLLM's InputProcessor._validate_params, absent in this vLLM; "
            "install a supported vLLM (0.32-0.33)"
        )
    return InputProcessor


def install_length_check() -> None:
    """Wrap ``InputProcessor._validate_params`` with :func:`check_length`; idempotent."""
    from vllm.exceptions import VLLMValidationError

    def make_wrapper(original: Any) -> Any:
        def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, params, *args, **kwargs)
            if hasattr(params, "max_tokens"):  # SamplingParams; PoolingParams carry no generation length
                try:
                    check_length(getattr(params, "extra_args", None), params.max_tokens, self.model_config.max_model_len)
                except ValueError as error:
                    raise VLLMValidationError(str(error), parameter="max_tokens") from None
            return result

        return _validate_params

    wrap_method(_input_processor(), "_validate_params", _ORIGINAL, make_wrapper)


def remove_length_check() -> None:
    """Restore vLLM's own ``_validate_params``."""
    from vllm.v1.engine.input_processor import InputProcessor

    restore_method(InputProcessor, "_validate_params", _ORIGINAL)


def length_check_installed() -> bool:
    from vllm.v1.engine.input_processor import InputProcessor

    return is_wrapped(InputProcessor, _ORIGINAL)
