"""Admission: refuse SpecPrefill requests that vLLM's own checks cannot see are wrong.

vLLM checks the compact prompt of ``K`` tokens; two things only the SpecPrefill arguments reveal:

- generated tokens take RoPE positions ``L, L+1, ...``, so ``L + max_tokens > max_model_len``
  must be refused;
- the kept positions must number exactly ``K``, one per prompt token (otherwise the runner would
  give tokens positions of other tokens).

The logits-processor hook of :mod:`.validation` sees neither the prompt nor the model config.
``InputProcessor.process_inputs`` (front-end process, every request, before anything reaches the
engine core) builds the ``EngineCoreRequest`` that holds both; the wrapper below checks that request
and raises vLLM's ``VLLMValidationError`` (as vLLM converts the errors of logits processors): an HTTP
400 on the OpenAI server (a plain ``ValueError`` there is a 500) and an exception from
``LLM.generate``. Installed by the plugin's ``register()``, removed by :func:`remove_admission_checks`.
"""

from __future__ import annotations

from typing import Any

from ..positions import PROMPT_LENGTH_KEY, RUNS_KEY
from .patching import is_wrapped, restore_method, wrap_method

_ORIGINAL = "_specprefill_original_process_inputs"


def _spec_arguments(extra_args: dict[str, Any] | None) -> tuple[int, list[int]] | None:
    """``(L, run lengths)`` of a well-formed SpecPrefill request; None for others (malformed ones are
    refused by :mod:`.validation`).
    """
    args = extra_args or {}
    length, runs = args.get(PROMPT_LENGTH_KEY), args.get(RUNS_KEY)
    if not isinstance(length, int) or not isinstance(runs, list | tuple):
        return None
    if not all(isinstance(n, int) for n in runs[1::2]):
        return None
    return length, list(runs[1::2])


def check_length(extra_args: dict[str, Any] | None, max_tokens: int | None, max_model_len: int) -> None:
    """Raise ``ValueError`` if a SpecPrefill request would generate past ``max_model_len``.

    ``max_tokens=None`` means vLLM's default, ``max_model_len - K``.
    """
    spec = _spec_arguments(extra_args)
    if spec is None:
        return
    length, run_lengths = spec
    if max_tokens is None:
        max_tokens = max_model_len - sum(run_lengths)
    if length + max_tokens > max_model_len:
        raise ValueError(
            f"SpecPrefill request: original prompt length L={length} + max_tokens={max_tokens} = "
            f"{length + max_tokens} exceeds max_model_len={max_model_len} (generated tokens take positions "
            f"L, L+1, ...); lower max_tokens to at most {max(max_model_len - length, 0)} or send fewer documents"
        )


def check_kept_count(extra_args: dict[str, Any] | None, prompt_tokens: int) -> None:
    """Raise ``ValueError`` unless the kept positions number exactly ``prompt_tokens``."""
    spec = _spec_arguments(extra_args)
    if spec is not None and sum(spec[1]) != prompt_tokens:
        raise ValueError(
            f"SpecPrefill request: {RUNS_KEY} cover {sum(spec[1])} positions but the prompt has {prompt_tokens} "
            "tokens; send exactly the kept token ids, one per kept position"
        )


def _input_processor() -> type:
    from vllm.v1.engine.input_processor import InputProcessor

    if not callable(getattr(InputProcessor, "process_inputs", None)):
        raise RuntimeError(
            "specprefill-rag's admission checks need vLLM's InputProcessor.process_inputs, absent in this vLLM; "
            "install a supported vLLM (0.32-0.33)"
        )
    return InputProcessor


def install_admission_checks() -> None:
    """Wrap ``InputProcessor.process_inputs`` with :func:`check_length` and :func:`check_kept_count`;
    idempotent.
    """
    from vllm.exceptions import VLLMValidationError

    def make_wrapper(original: Any) -> Any:
        def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
            request = original(self, *args, **kwargs)
            params = request.sampling_params  # None for pooling requests: no generation, no positions
            if params is not None:
                try:
                    check_length(params.extra_args, params.max_tokens, self.model_config.max_model_len)
                    if request.prompt_token_ids is not None:
                        check_kept_count(params.extra_args, len(request.prompt_token_ids))
                except ValueError as error:
                    raise VLLMValidationError(str(error)) from None
            return request

        return process_inputs

    wrap_method(_input_processor(), "process_inputs", _ORIGINAL, make_wrapper)


def remove_admission_checks() -> None:
    """Restore vLLM's own ``process_inputs``."""
    from vllm.v1.engine.input_processor import InputProcessor

    restore_method(InputProcessor, "process_inputs", _ORIGINAL)


def admission_checks_installed() -> bool:
    from vllm.v1.engine.input_processor import InputProcessor

    return is_wrapped(InputProcessor, _ORIGINAL)
