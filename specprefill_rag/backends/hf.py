"""Main model on Hugging Face transformers, in-process, CPU or GPU.

Prefill passes ``position_ids`` explicitly and a fresh cache, so transformers neither re-derives
positions nor mistakes non-contiguous positions for packed sequences. The KV cache holds only the
``K`` kept tokens; decode step ``t`` writes cache slot ``K + t`` at RoPE position ``L + t``.

With a prefix cache, the KV of every request's forwarded tokens (its sparse prompt and the tokens it
generated) is kept, keyed by (token id, position) pairs: a token's KV depends on the ids and positions
of the tokens before it, so a later request whose leading pairs agree (the next turn of a conversation,
whose stable selection extends this one's sparse prompt; another question over the same instructions)
starts from that KV and prefills only the rest. Same ids at other positions never match, nor do another
namespace's entries (``prompt.namespace``: a tenant of the gateway).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncGenerator, Generator, Iterable
from contextlib import nullcontext
from typing import Any

import torch

from ..config import GenerationParams, GrammarLimits, OutputFormat
from ..decode.constraints import ConstraintCompiler, TokenConstraint
from ..decode.sampling import apply_penalties, log_probabilities, next_token, step_logprobs
from ..errors import InvalidRequestError
from ..kvcache.prefix_cache import PrefixKVCache, PrefixReuse
from ..results import PrefillReport
from .base import SparsePrompt
from .threads import iterate_in_thread

logger = logging.getLogger(__name__)

# Any reuse pays on the main model: a cached token skips every layer's MLP, the bulk of its cost.
MAIN_MIN_REUSE_SHARE = 0.0
# A position shifted past a token id's bits: (id, position) pairs compare as one int64 each.
_POSITION_BITS = 32


def position_keyed(token_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``[n]`` ids and ``[n]`` positions -> ``[n]`` int64 keys, equal exactly where both agree."""
    return (token_ids.long().cpu() << _POSITION_BITS) | position_ids.long().cpu()


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids from the generation config (the chat template's end token) and the tokenizer."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids: Iterable[Any] = configured if isinstance(configured, (list, tuple)) else [configured]
    return frozenset(int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None)


class HFBackend:
    """A transformers causal LM as a :class:`~specprefill_rag.backends.base.MainBackend`.

    Args:
        model: a causal LM loaded with SDPA or eager attention.
        eos_ids: token ids that end generation.
        lock: serialises forward passes when several requests share the model.
        tokenizer: the model's tokenizer, for output constrained by ``params.output_format``
            (:mod:`specprefill_rag.decode.constraints`); None: such requests are refused.
        prefix_cache: where the KV of sparse prompts is kept for later requests (keyed by ids and positions);
            None: every request prefills all its tokens.
    """

    supports_sparse_prefill = True

    def __init__(
        self,
        model: Any,
        eos_ids: frozenset[int],
        lock: threading.RLock | None = None,
        tokenizer: Any = None,
        prefix_cache: PrefixKVCache | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        self.model = model
        self.grammar_limits = grammar_limits or GrammarLimits()
        self.prefix_cache = prefix_cache
        self.eos_ids = eos_ids
        self._lock = lock or nullcontext()
        self._tokenizer = tokenizer
        self._compiler: ConstraintCompiler | None = None
        self._compiler_lock = threading.Lock()

    @property
    def context_length(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, first_slot: int, cache: Any) -> torch.Tensor:
        """Run ``[n]`` tokens at RoPE ``positions`` into cache slots ``first_slot..``; ``[V]`` next-token logits."""
        slots = torch.arange(first_slot, first_slot + token_ids.numel(), device=self.device)
        with self._lock:
            output = self.model(
                input_ids=token_ids.view(1, -1).to(self.device),
                position_ids=positions.view(1, -1).to(self.device),
                cache_position=slots,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return output.logits[0, -1]

    def check_output_format(self, output_format: OutputFormat) -> None:
        """Compile the format now (cached), so a schema that cannot be enforced is refused before any work (a lazy
        one, ``tool_choice="auto"``, never is: see :meth:`_constraint`).
        """
        self._grammar(output_format)

    def _constraint(self, output_format: OutputFormat | None) -> TokenConstraint | None:
        """A fresh grammar state for ``output_format``; None without one, or when a lazy one has no grammar."""
        grammar = self._grammar(output_format) if output_format is not None else None
        if output_format is None or grammar is None:
            return None
        return TokenConstraint(grammar, self._constraints().vocab_size, output_format.kind)

    def _grammar(self, output_format: OutputFormat) -> Any:
        """The compiled grammar of ``output_format`` (cached). A lazy format whose grammar cannot be built (over a
        schema limit, uncompilable, no xgrammar, no tokenizer) gives None and a warning: ``auto`` then decodes
        freely and the calls are parsed from the text as written, as before lazy grammars, rather than refuse
        the request.
        """
        try:
            return self._constraints().compiled(output_format)
        except InvalidRequestError as error:
            if not output_format.lazy:
                raise
            logger.warning("tool_choice='auto' without its lazy tool-call grammar (calls parsed as written): %s", error)
            return None

    def _constraints(self) -> ConstraintCompiler:
        """The compiler of this model's grammars, built on first use (its tokenizer tables cost ~0.5 s)."""
        if self._tokenizer is None:
            raise InvalidRequestError("this backend was built without its tokenizer, so it cannot constrain output")
        with self._compiler_lock:
            if self._compiler is None:
                width = int(self.model.get_output_embeddings().weight.shape[0])
                self._compiler = ConstraintCompiler(
                    self._tokenizer, width, self.grammar_limits, stop_token_ids=sorted(self.eos_ids)
                )
            return self._compiler

    def generate(
        self, prompt: SparsePrompt, params: GenerationParams, report: PrefillReport | None = None
    ) -> Generator[int, None, None]:
        """Yield generated token ids; with ``params.output_format`` only tokens its grammar allows, ending when
        the grammar is complete. ``report.cached_tokens``: prompt tokens the prefix cache served (from entries of
        ``prompt.namespace`` only);
        ``report.logprobs`` (``params.logprobs``): each token's, from the logits before penalties and constraints.
        """
        constraint = self._constraint(params.output_format)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        kept = prompt.token_ids.numel()
        keys = position_keyed(prompt.token_ids, prompt.position_ids)
        layers = int(self.model.config.num_hidden_layers)
        reuse = PrefixReuse.begin(
            self.prefix_cache, self.model, layers, keys, kept - 1, needs_past=True, namespace=prompt.namespace
        )
        cache, start = reuse.past, reuse.cached_tokens
        if report is not None:
            report.cached_tokens = start
        logits = self._forward(prompt.token_ids[start:], prompt.position_ids[start:], start, cache)
        forwarded = [keys]  # what the cache holds: the prompt, then each generated token fed back
        counts = torch.zeros(logits.numel(), device=logits.device)  # generated tokens, for the penalties
        reported = report.logprobs if report is not None and params.logprobs else None
        try:
            for step in range(params.max_new_tokens):
                raw = log_probabilities(logits) if reported is not None else None  # before mask_ changes logits
                logits = apply_penalties(logits, counts, params.presence_penalty, params.frequency_penalty)
                if constraint is not None:
                    constraint.mask_(logits)
                token = next_token(logits, params.temperature, params.top_p, generator)
                if token in self.eos_ids:
                    return
                if reported is not None and raw is not None:
                    reported.append(step_logprobs(raw, token, params.top_logprobs))
                counts[token] += 1
                if constraint is not None:
                    constraint.accept(token)
                yield token
                if constraint is not None and constraint.finished:
                    return
                if step + 1 < params.max_new_tokens:
                    position = torch.tensor([prompt.prompt_length + step])
                    logits = self._forward(torch.tensor([token]), position, kept + step, cache)
                    forwarded.append(position_keyed(torch.tensor([token]), position))
        finally:
            reuse.remember(torch.cat(forwarded))

    def agenerate(
        self, prompt: SparsePrompt, params: GenerationParams, report: PrefillReport | None = None
    ) -> AsyncGenerator[int, None]:
        """:meth:`generate` in a worker thread, its tokens yielded on the event loop."""
        return iterate_in_thread(lambda: self.generate(prompt, params, report))
