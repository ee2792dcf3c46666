"""Main model on vLLM: in-process (``vllm.LLM``) or behind an OpenAI-compatible server.

Either way the server side needs this package installed (its ``vllm.general_plugins`` entry point
remaps positions). A compressed request sends the kept token ids as a token-id prompt, and the original
length and run-length-encoded kept positions in ``extra_args`` (``vllm_xargs`` over HTTP). The plugin
keys vLLM's prefix-cache blocks by token ids AND positions, so KV computed at other positions is never
reused while earlier turns of a conversation (and ordinary requests' leading blocks) are. Only for a
plugin that does not say so (no :data:`~specprefill_rag.positions.POSITION_KEYED_BLOCKS` in its probe
answer; in process: not installed here) does the request also carry a ``cache_salt`` derived from all
its positions, which rules out that reuse but keeps KV correct. A prompt of a namespace (a gateway tenant) carries a
``cache_salt`` of it in either case, vLLM's own way of keeping one client's prefix-cache blocks from
another's (with position-keyed blocks, the salt stays in block 0's extra keys and ours are added after it).
The draft runs on the client side.

Prefill report: prompt tokens served by vLLM's prefix cache (``RequestOutput.num_cached_tokens``
in process; over HTTP ``usage.prompt_tokens_details.cached_tokens`` of the stream's last event, sent by
a server started with ``--enable-prompt-tokens-details``, else None).

The server client streams over HTTP with the standard library (:meth:`VLLMServerBackend.generate`)
or natively on an event loop with ``httpx`` (:meth:`VLLMServerBackend.agenerate`); both share the
request body, the SSE parsing and the error mapping.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, Generator, Iterator, Mapping
from typing import Any, Literal

import httpx

from ..arguments import check_number, shown
from ..config import GenerationParams, GrammarLimits, OutputFormat
from ..decode.constraints import json_grammar
from ..decode.formats import marker_tokens, tool_call_structural_tag, validate_format
from ..decode.schema_limits import check_format_limits
from ..errors import InvalidRequestError, SpecPrefillError, TokenizerMismatchError
from ..positions import (
    POSITION_KEYED_BLOCKS,
    PROBE_KEY,
    PROBE_MARKER,
    PROMPT_LENGTH_KEY,
    RUNS_KEY,
    cache_salt,
    encode_runs,
    namespace_salt,
)
from ..results import PrefillReport, StepLogprobs
from .base import SparsePrompt
from .threads import iterate_in_thread
from .vllm_wire import (
    StreamEvent,
    VLLMServerError,
    VLLMServerTimeout,
    check_server_url,
    cut_short,
    interrupted,
    malformed,
    refused,
    sse_tokens,
    unreachable,
)

logger = logging.getLogger(__name__)

__all__ = [
    "VLLMOfflineBackend",
    "VLLMServerBackend",
    "VLLMServerError",
    "VLLMServerTimeout",
    "connect",
    "request_fields",
    "sse_tokens",
]


def _is_sparse(prompt: SparsePrompt) -> bool:
    return prompt.token_ids.numel() != prompt.prompt_length


def request_fields(prompt: SparsePrompt, salt: bool = True) -> dict[str, Any]:
    """Token ids plus, for a compressed prompt, the SpecPrefill arguments and, with ``salt`` (a server
    whose block hashes do not cover positions), the cache salt of all its positions; a prompt of a namespace
    (``prompt.namespace``) always carries a salt of it.
    """
    fields: dict[str, Any] = {"prompt_token_ids": prompt.token_ids.tolist()}
    if prompt.namespace is not None:
        fields["cache_salt"] = namespace_salt(prompt.namespace)
    if _is_sparse(prompt):
        runs = encode_runs(prompt.position_ids)
        fields["extra_args"] = {PROMPT_LENGTH_KEY: prompt.prompt_length, RUNS_KEY: runs}
        if salt:
            fields["cache_salt"] = cache_salt(prompt.prompt_length, runs, prompt.namespace)
    return fields


def keys_blocks_in_process() -> bool:
    """Whether this process's vLLM hashes prefix-cache blocks with their positions (the plugin's
    :mod:`~specprefill_rag.vllm_plugin.block_keys` installed, as ``register()`` does when vLLM loads it).
    """
    try:
        from ..vllm_plugin.block_keys import position_keyed_blocks_installed
    except ImportError:  # pragma: no cover - the plugin's modules need vLLM
        return False
    return position_keyed_blocks_installed()


def structured_outputs(
    output_format: OutputFormat, markers: Mapping[str, int] | None = None, limits: GrammarLimits | None = None
) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` for ``output_format``, which vLLM's xgrammar backend enforces: ``json`` for a
    strict schema, ``json_object``, the ``grammar`` of :func:`~specprefill_rag.decode.constraints.json_grammar`
    for a schema with ``strict=False`` (vLLM compiles its ``json`` strictly), and for a forced tool call the
    ``structural_tag`` (a JSON string) of :func:`~specprefill_rag.decode.formats.tool_call_structural_tag`, the
    grammar an in-process main uses.
    ``markers``: the tool-call markers the served tokenizer writes as one token, with their ids
    (:func:`tool_markers`); a tool_call format needs them. ``limits`` (default
    :class:`~specprefill_rag.config.GrammarLimits`'s) are checked first: vLLM's compile cannot be interrupted either.
    """
    check_format_limits(output_format, limits or GrammarLimits())
    validate_format(output_format)
    if output_format.kind == "json_object":
        return {"json_object": True}
    if output_format.kind == "json_schema" and output_format.schema is not None:
        if not output_format.strict:
            return {"grammar": json_grammar(output_format, limits)}
        return {"json": dict(output_format.schema)}
    if markers is None and not output_format.lazy:  # a lazy tag matches its markers as text
        raise InvalidRequestError(
            "a forced tool call (tool_choice 'required' or a named tool) with a vLLM main needs the served model's "
            "tokenizer, to write its tool-call markers as their tokens; build the engine with "
            "SpecPrefillEngine.for_vllm, or call backend.adopt_tokenizer(tokenizer, eos_ids) first"
        )
    tag = tool_call_structural_tag(output_format, markers or {})
    return {"structural_tag": json.dumps(tag, ensure_ascii=False, separators=(",", ":"))}


def request_outputs(
    output_format: OutputFormat | None, markers: Mapping[str, int] | None, limits: GrammarLimits | None
) -> dict[str, Any] | None:
    """:func:`structured_outputs` of a request's ``output_format`` (None without one). A lazy format
    (``tool_choice="auto"``) that cannot be enforced gives None and a warning, not an error: the answer is then
    decoded freely and its calls parsed as written, as before lazy grammars.
    """
    if output_format is None:
        return None
    try:
        return structured_outputs(output_format, markers, limits)
    except InvalidRequestError as error:
        if not output_format.lazy:
            raise
        logger.warning("tool_choice='auto' without its lazy tool-call grammar (calls parsed as written): %s", error)
        return None


def tool_markers(tokenizer: Any, vocab_size: int | None = None) -> dict[str, int]:
    """The tool-call markers ``tokenizer`` writes as one token (ids below ``vocab_size``, default its length)."""
    return marker_tokens(tokenizer, len(tokenizer) if vocab_size is None else vocab_size)


def _without_eos(tokens: list[int], eos_ids: frozenset[int]) -> Iterator[int]:
    for token in tokens:
        if token in eos_ids:
            return
        yield token


def _reporting_logprobs(
    tokens: Iterator[int], steps: Any, params: GenerationParams, report: PrefillReport | None
) -> Iterator[int]:
    """``tokens``, each one's log-probabilities put in ``report.logprobs`` before it is yielded
    (``params.logprobs``), from vLLM's ``{token id: Logprob}`` per generated token (``steps``).
    """
    for index, token in enumerate(tokens):
        if params.logprobs and report is not None:
            candidates = {int(i): float(entry.logprob) for i, entry in steps[index].items()}
            report.logprobs.append(StepLogprobs.from_candidates(token, candidates, params.top_logprobs))
        yield token


class VLLMOfflineBackend:
    """An in-process ``vllm.LLM`` (started with this package installed, so the plugin is loaded).

    Generates the whole answer in one call; tokens are yielded once it is done.
    """

    supports_sparse_prefill = True

    def __init__(self, llm: Any, eos_ids: frozenset[int]) -> None:
        self.llm = llm
        self.eos_ids = eos_ids
        self._markers: dict[str, int] | None = None
        self.grammar_limits = GrammarLimits()  # SpecPrefillEngine.for_vllm sets its config's

    @property
    def context_length(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    def adopt_tokenizer(self, tokenizer: Any, eos_ids: frozenset[int]) -> None:
        """Use the end-of-sequence ids of the engine's tokenizer, after checking it is the served model's
        (skipped when the engine runs without a tokenizer).
        """
        served = self.llm.get_tokenizer() if hasattr(self.llm, "get_tokenizer") else None
        if served is not None and hasattr(served, "get_vocab") and served.get_vocab() != tokenizer.get_vocab():
            raise TokenizerMismatchError(
                "the vLLM model's tokenizer differs from the local one; pass tokenizer= with the served model's HF "
                "id or folder (a draft of another vocabulary is then mapped)"
            )
        self.eos_ids = eos_ids

    def _tool_markers(self) -> dict[str, int] | None:
        """The engine tokenizer's single-token tool-call markers (None when it runs without a tokenizer)."""
        if self._markers is None and hasattr(self.llm, "get_tokenizer"):
            served = self.llm.get_tokenizer()
            if served is not None:
                self._markers = tool_markers(served, self.llm.llm_engine.model_config.get_vocab_size())
        return self._markers

    def check_output_format(self, output_format: OutputFormat) -> None:
        request_outputs(output_format, self._tool_markers(), self.grammar_limits)

    def generate(
        self, prompt: SparsePrompt, params: GenerationParams, report: PrefillReport | None = None
    ) -> Generator[int, None, None]:
        """Generate the whole answer, then yield it; ``report.cached_tokens`` from the request's
        ``num_cached_tokens`` (prompt tokens vLLM's prefix cache served).
        """
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        fields = request_fields(prompt, salt=not keys_blocks_in_process())
        outputs = request_outputs(params.output_format, self._tool_markers(), self.grammar_limits)
        constrained = outputs and StructuredOutputsParams(**outputs)
        sampling = SamplingParams(
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            extra_args=fields.pop("extra_args", None),
            detokenize=False,
            structured_outputs=constrained or None,
            logprobs=params.top_logprobs if params.logprobs else None,
        )
        output = self.llm.generate([fields], sampling, use_tqdm=False)[0]
        if report is not None:
            cached = getattr(output, "num_cached_tokens", None)
            report.cached_tokens = int(cached) if cached is not None else None
        completion = output.outputs[0]
        tokens = _without_eos(list(completion.token_ids), self.eos_ids)
        yield from _reporting_logprobs(tokens, completion.logprobs, params, report)

    def agenerate(
        self, prompt: SparsePrompt, params: GenerationParams, report: PrefillReport | None = None
    ) -> AsyncGenerator[int, None]:
        """:meth:`generate` in a worker thread (``vllm.LLM`` has no async interface)."""
        return iterate_in_thread(lambda: self.generate(prompt, params, report))


def _event_logprobs(event: StreamEvent, line: str | bytes) -> tuple[StepLogprobs, ...]:
    """The log-probabilities of an event's tokens, which a request with ``logprobs`` must carry."""
    if len(event.logprobs) != len(event.tokens):
        raise malformed(line, f"{len(event.tokens)} tokens but {len(event.logprobs)} log-probabilities")
    return event.logprobs


class _Stream:
    """Reading one streamed completion, for the blocking and the async client alike: tokens counted
    against ``max_tokens``, the usage event into ``report``. Read on to the end of the body after
    ``[DONE]`` (the connection stays usable); after an end-of-sequence token only the usage event and
    ``[DONE]`` are still worth reading (stop at once without a report, or if the server generates on).
    """

    def __init__(self, backend: VLLMServerBackend, params: GenerationParams, report: PrefillReport | None) -> None:
        self.backend, self.params, self.report = backend, params, report
        self.received, self.done, self.eos = 0, False, False

    @property
    def complete(self) -> bool:
        """The answer ended: ``[DONE]`` or an end-of-sequence token (else the stream was cut short)."""
        return self.done or self.eos

    def feed(self, line: str | bytes) -> tuple[list[int], bool]:
        """The tokens of one line to yield, and whether to stop reading."""
        event = sse_tokens(line, self.backend.eos_ids, self.report, self.params.top_logprobs)
        self.done = self.done or event.end == "done"
        if self.eos:
            return [], bool(event.tokens) or event.end == "eos"
        self.received = self.backend._count(self.received, event.tokens, self.params)
        self.eos = event.end == "eos"
        if self.params.logprobs and self.report is not None:
            self.report.logprobs.extend(_event_logprobs(event, line))
        return event.tokens, self.eos and self.report is None


class VLLMServerBackend:
    """A ``vllm serve`` / ``python -m vllm.entrypoints.openai.api_server`` endpoint.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        eos_ids: end-of-sequence ids of the model (the server includes them in ``token_ids``).
        model: served model name; default the first one the server lists.
        timeout: seconds for connecting and for each read.
        on_missing_plugin: ``"error"`` (raise at construction) or ``"full_prompt"`` (send whole prompts;
            the engine then reports ``compressed=False``).

    Attributes:
        supports_sparse_prefill: the probe found the plugin.
        position_keyed_blocks: its probe answer says prefix-cache blocks are keyed by position; otherwise
            compressed requests carry a ``cache_salt`` of all their positions.
    """

    def __init__(
        self,
        base_url: str,
        eos_ids: frozenset[int],
        model: str | None = None,
        timeout: float = 60.0,
        on_missing_plugin: Literal["error", "full_prompt"] = "error",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.eos_ids = eos_ids
        self.timeout = timeout
        self._ssl: ssl.SSLContext | None = None
        self._async_clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._async_clients_lock = threading.Lock()
        self._markers: dict[str, int] | None = None  # the adopted tokenizer's single-token tool-call markers
        self.grammar_limits = GrammarLimits()  # SpecPrefillEngine.for_vllm sets its config's
        card = self._model_card()
        self.model = model or card["id"]
        self._context_length = int(card.get("max_model_len") or 0)
        self.supports_sparse_prefill, self.position_keyed_blocks = self._probe()
        if not self.supports_sparse_prefill and on_missing_plugin == "error":
            raise VLLMServerError(
                f"the vLLM server at {self.base_url} does not have the specprefill-rag plugin; install "
                "specprefill-rag in the server's environment and restart it, or pass on_missing_plugin='full_prompt'"
            )

    @property
    def context_length(self) -> int:
        return self._context_length

    def _model_card(self) -> dict[str, Any]:
        """The first model ``/v1/models`` lists."""
        listing = self._request("GET", "/v1/models")
        try:
            card = listing["data"][0]
            int(card.get("max_model_len") or 0), str(card["id"])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise VLLMServerError(
                f"{self.base_url}/v1/models lists no model in vLLM's format ({shown(listing)}); check the URL"
            ) from None
        return card

    def adopt_tokenizer(self, tokenizer: Any, eos_ids: frozenset[int]) -> None:
        """Use the main model's tokenizer's end-of-sequence ids, after checking the server tokenizes as it does."""
        markers = tool_markers(tokenizer)
        check_server_tokenizer(self, tokenizer, markers)
        self.eos_ids = eos_ids
        self._markers = markers

    def _open(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            raise refused(error.code, error.read().decode(errors="replace")) from None
        except (urllib.error.URLError, OSError) as error:
            raise unreachable(self.base_url, self.timeout, error) from None

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        with self._open(method, path, body) as response:
            try:
                return json.loads(response.read())
            except (ValueError, OSError, http.client.HTTPException) as error:
                raise VLLMServerError(
                    f"{self.base_url}{path} answered with something that is not JSON ({error}); "
                    "check that the URL is a vLLM OpenAI-compatible server"
                ) from None

    def _probe(self) -> tuple[bool, bool]:
        """Whether the server refuses a probe request with the plugin's marker, and whether the refusal
        also says its prefix-cache blocks are keyed by position (otherwise requests carry a cache salt).
        """
        body = {"model": self.model, "prompt": [0], "max_tokens": 1, "vllm_xargs": {PROBE_KEY: 1}}
        try:
            self._request("POST", "/v1/completions", body)
        except InvalidRequestError as error:
            present = PROBE_MARKER in str(error)
            return present, present and POSITION_KEYED_BLOCKS in str(error)
        return False, False

    def check_output_format(self, output_format: OutputFormat) -> None:
        request_outputs(output_format, self._markers, self.grammar_limits)

    def _body(self, prompt: SparsePrompt, params: GenerationParams) -> dict[str, Any]:
        fields = request_fields(prompt, salt=not self.position_keyed_blocks)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": fields["prompt_token_ids"],
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},  # the last event's usage: prefix-cache hits (report)
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.presence_penalty or params.frequency_penalty:
            body.update(presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)
        outputs = request_outputs(params.output_format, self._markers, self.grammar_limits)
        if outputs is not None:
            body["structured_outputs"] = outputs
        if params.logprobs:  # the chosen token's and the top ones', keyed "token_id:<id>" (sse_tokens reads them)
            body.update(logprobs=params.top_logprobs, return_tokens_as_token_ids=True)
        if "extra_args" in fields:
            body["vllm_xargs"] = fields["extra_args"]
        if "cache_salt" in fields:
            body["cache_salt"] = fields["cache_salt"]
        return body

    def _count(self, received: int, tokens: list[int], params: GenerationParams) -> int:
        """Tokens received so far; more than were asked for means the server is not honouring the request
        (it would otherwise stream forever without a read ever timing out).
        """
        if received + len(tokens) > params.max_new_tokens:
            raise VLLMServerError(
                f"the server at {self.base_url} sent more than max_tokens={params.max_new_tokens} tokens; "
                "check that the URL is a vLLM OpenAI-compatible server"
            )
        return received + len(tokens)

    def _check_prompt(self, prompt: SparsePrompt) -> None:
        if _is_sparse(prompt) and not self.supports_sparse_prefill:
            raise InvalidRequestError("this server has no specprefill plugin; send the full prompt")

    def generate(
        self, prompt: SparsePrompt, params: GenerationParams, report: PrefillReport | None = None
    ) -> Generator[int, None, None]:
        """Stream the answer; ``report.cached_tokens`` from the usage event (None when the server sends
        no ``prompt_tokens_details``, or the generator is closed before the stream ends).
        """
        self._check_prompt(prompt)
        stream = _Stream(self, params, report)
        with self._open("POST", "/v1/completions", self._body(prompt, params)) as response:
            try:
                for line in response:
                    tokens, stop = stream.feed(line)
                    yield from tokens
                    if stop:
                        return
            except (OSError, http.client.HTTPException) as error:  # a read timed out or the connection dropped
                if stream.eos:  # only the usage event was still to come: the answer is complete
                    return
                raise interrupted(self.base_url, self.timeout, stream.received, error) from None
        if not stream.complete:
            raise cut_short(self.base_url, stream.received)

    async def agenerate(
        self, prompt: SparsePrompt, params: GenerationParams, report: PrefillReport | None = None
    ) -> AsyncGenerator[int, None]:
        """:meth:`generate` on the event loop (``httpx``): same request, tokens, errors and early close;
        closing this generator closes the HTTP response.
        """
        self._check_prompt(prompt)
        url = self.base_url + "/v1/completions"
        stream, answered = _Stream(self, params, report), False
        try:
            async with self._async_client().stream("POST", url, json=self._body(prompt, params)) as response:
                answered = True
                if response.status_code >= 400:
                    detail = (await response.aread()).decode(errors="replace")
                    raise refused(response.status_code, detail)
                async for line in response.aiter_lines():
                    tokens, stop = stream.feed(line)
                    for token in tokens:
                        yield token
                    if stop:
                        return
        except httpx.RequestError as error:  # connect or read timed out, refused, dropped mid-stream
            if stream.eos:  # only the usage event was still to come: the answer is complete
                return
            if answered:
                raise interrupted(self.base_url, self.timeout, stream.received, error) from None
            raise unreachable(self.base_url, self.timeout, error) from None
        if not stream.complete:
            raise cut_short(self.base_url, stream.received)

    def _async_client(self) -> httpx.AsyncClient:
        """One pooled client per event loop: requests on a loop reuse its connections (no new TCP or TLS
        handshake per request); an httpx client cannot outlive or cross the loop it connected on.
        No connection cap: each stream holds a connection until it ends, and a cap would queue them.
        """
        loop = asyncio.get_running_loop()
        with self._async_clients_lock:
            for closed in [other for other in self._async_clients if other.is_closed()]:
                del self._async_clients[closed]  # its connections died with it; drop both
            if loop not in self._async_clients:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
                self._async_clients[loop] = httpx.AsyncClient(
                    timeout=self.timeout, verify=self._ssl_context(), limits=limits
                )
            return self._async_clients[loop]

    def _ssl_context(self) -> ssl.SSLContext:
        """One TLS context per backend: building httpx's default one costs tens of ms per client."""
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl


def connect(
    server: str | Any, timeout: float = 60.0, on_missing_plugin: Literal["error", "full_prompt"] = "error"
) -> VLLMServerBackend | VLLMOfflineBackend:
    """The backend for a vLLM server URL (contacted now, so an unreachable one fails before any model
    loads) or for an in-process ``vllm.LLM``; end-of-sequence ids come later, from the draft.
    """
    if on_missing_plugin not in ("error", "full_prompt"):
        raise InvalidRequestError(
            f"on_missing_plugin must be 'error' or 'full_prompt', got {shown(on_missing_plugin)}; pass one of them"
        )
    if isinstance(server, str):
        check_server_url(server)
        check_number(timeout, "timeout", "pass the seconds to wait for the server, e.g. timeout=60")
        if timeout <= 0:
            raise InvalidRequestError(f"timeout must be > 0 seconds, got {timeout}; pass e.g. timeout=60")
        return VLLMServerBackend(server, frozenset(), timeout=timeout, on_missing_plugin=on_missing_plugin)
    if not hasattr(server, "llm_engine"):
        raise InvalidRequestError(
            f"server must be the http(s) URL of a vLLM server or an in-process vllm.LLM, got {type(server).__name__}; "
            "pass e.g. 'http://127.0.0.1:8000'"
        )
    return VLLMOfflineBackend(server, frozenset())


def check_server_tokenizer(
    backend: VLLMServerBackend,
    tokenizer: Any,
    markers: Mapping[str, int] | None = None,
    sample: str = "SpecPrefill checks 1, 2, 3.",
) -> None:
    """Raise when the server's tokenizer splits ``sample`` differently from the local one, or holds any of the
    tool-call ``markers`` (text -> the local tokenizer's single id) as one token of another id, which a forced
    tool call would then name. A server that splits a marker's text is not judged by it: mistral_common (vLLM's
    ``--tokenizer-mode mistral``) never reads control tokens from text. Skipped when the server runs without a
    tokenizer.
    """
    served = _served_tokens(backend, sample)
    if served is None:
        return
    local = tokenizer(sample, add_special_tokens=False)["input_ids"]
    if served != list(local):
        raise TokenizerMismatchError(
            f"the server's model tokenizes differently from the local tokenizer ({served} vs {local}); "
            "pass tokenizer= with the served model's HF id or folder (a draft of another vocabulary is then mapped)"
        )
    for marker, token in (markers or {}).items():
        marker_ids = _served_tokens(backend, marker)
        if marker_ids is not None and len(marker_ids) == 1 and marker_ids != [token]:
            raise TokenizerMismatchError(
                f"the server's model writes the tool-call marker {marker!r} as {marker_ids}, the local tokenizer as "
                f"[{token}]; pass tokenizer= with the served model's HF id or folder"
            )


def _served_tokens(backend: VLLMServerBackend, text: str) -> list[int] | None:
    """The server's ``/tokenize`` of ``text`` (no special tokens added); None when it has no tokenizer."""
    try:
        served = backend._request(
            "POST", "/tokenize", {"model": backend.model, "prompt": text, "add_special_tokens": False}
        )
    except SpecPrefillError:
        return None
    return list(served.get("tokens", []))
