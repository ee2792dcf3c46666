"""The gateway's HTTP layer: vLLM's OpenAI API in front of :class:`~specprefill_rag.serve.gateway.Gateway`.

``create_app(settings)`` builds the engine (or takes one), the draft queue and the routes:
``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``), ``GET /v1/models``,
``POST /tokenize``, ``POST /v1/spec_prefill/documents/warm`` (the per-document draft cache, at ingestion),
``GET /health``, ``GET /metrics``. Every request passes the admission of
:mod:`~specprefill_rag.serve.guard` first (a key on every route but ``/health``, ``/metrics`` its own when
set, the bound on requests in flight, a JSON body of bounded size read under a deadline), inside the Host
allow-list and, when configured, CORS. The key (or declared tenant) a request came with names its tenant
(:mod:`~specprefill_rag.serve.tenancy`), the namespace of every cache it reads or fills.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from .. import __version__
from ..config import WARM_DOCUMENTS_PATH, GenerationParams
from ..engine import SpecPrefillEngine
from ..errors import InvalidRequestError, SpecPrefillError
from ..prompt.chat import ChatLayout
from ..results import ToolCall
from .errors import GatewayError, WireNames, as_gateway_error, bad_request, echoed
from .gateway import Answer, Gateway, Plan
from .guard import RequestGuard
from .layouts import (
    chat_request_decoding,
    chat_request_layout,
    check_output_format,
    completion_request_layout,
    tokenize_request,
)
from .request_stream import ClientGone, RequestStream, client_gone
from .responses import CHAT, HEADER_NAMES, TEXT, ApiFormat, ResponseWriter, sse, stats_headers, with_invalid_calls
from .schema import ChatCompletionRequest, CompletionRequest, TokenizeRequest, WarmDocumentsRequest, first_problem
from .settings import GatewaySettings

log = logging.getLogger("specprefill_rag.serve")
DecodingFields = Callable[[Any, ChatLayout], dict[str, Any]]
"""A request's body and layout -> its extra GenerationParams fields (tool-call markup, output format)."""


def build_engine(settings: GatewaySettings) -> SpecPrefillEngine:
    """The engine the settings describe: a vLLM server's client, or the main model in-process."""
    config = settings.engine_config()
    if settings.main_is_remote:
        timeout = settings.upstream_timeout_s
        return SpecPrefillEngine.for_vllm(settings.main, config, settings.on_missing_plugin, timeout)
    return SpecPrefillEngine(config)


def _served_name(settings: GatewaySettings, engine: SpecPrefillEngine) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return str(getattr(engine.backend, "model", None) or settings.main) if settings.main_is_remote else settings.main


def create_app(settings: GatewaySettings | None = None, engine: SpecPrefillEngine | None = None) -> FastAPI:
    """The gateway as an ASGI app; ``engine`` replaces the one ``settings`` describe (tests, embedding)."""
    settings = settings or GatewaySettings()
    gateway = Gateway(settings, engine or build_engine(settings))
    served = _served_name(settings, gateway.engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not settings.api_keys() and not settings.is_loopback:
            log.warning(
                "no --api-key: the gateway at %s is open to anyone who can reach it, and its clients share its "
                "caches (one tenant)",
                settings.host,
            )
        gateway.queue.start()
        yield
        await gateway.queue.stop()
        gateway.grammar_workers.shutdown()
        gateway.warm_workers.shutdown()

    app = FastAPI(title="SpecPrefill gateway", version=__version__, lifespan=lifespan)
    app.state.gateway = gateway
    _guards(app, gateway, settings)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, error: GatewayError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    _info_routes(app, gateway, settings, served)
    _completion_routes(app, gateway, settings, served)
    _document_routes(app, gateway)
    return app


def _guards(app: FastAPI, gateway: Gateway, settings: GatewaySettings) -> None:
    """Admission (key, bound, body), then CORS when configured, then the Host allow-list outermost."""
    metrics_key = settings.metrics_key.get_secret_value() if settings.metrics_key is not None else None
    tenant_header = [settings.tenant_header] if settings.tenant_header is not None else []
    body_limit = settings.resolved_max_body_bytes(gateway.engine.backend.context_length)
    app.add_middleware(
        RequestGuard,
        api_keys=settings.api_keys(),
        slots=gateway.slots,
        readers=gateway.readers,
        max_body_bytes=body_limit,
        body_timeout_s=settings.body_timeout_s,
        count=gateway.metrics.finished,
        metrics_keys=(metrics_key,) if metrics_key is not None else (),
    )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", *tenant_header],
            expose_headers=list(HEADER_NAMES),
        )
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.resolved_allowed_hosts()))


def _info_routes(app: FastAPI, gateway: Gateway, settings: GatewaySettings, served: str) -> None:
    engine = gateway.engine

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "spec_prefill_gateway": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = gateway.metrics.exposition()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        gateway_card = {
            "gateway": True,
            "version": __version__,
            "draft": settings.draft,
            "keep_rate": settings.keep_rate,
        }
        card = {
            "id": served,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "specprefill-rag",
            "root": settings.main,
            "max_model_len": engine.backend.context_length,
            "spec_prefill": gateway_card,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = _parse(TokenizeRequest, await _json(request))
        if body.model is not None and body.model != served:
            raise _unknown_model(body.model, served)
        context = engine.backend.context_length
        try:
            ids = await asyncio.to_thread(tokenize_request, engine.tokenizer, body, context)
        except InvalidRequestError as error:
            raise bad_request(str(error), "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": context}


def _document_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post(WARM_DOCUMENTS_PATH)
    async def warm_documents(request: Request) -> Any:
        """Draft documents into the per-document cache: ``{"warmed", "documents", "held", "skipped",
        "cache_bytes", "cache_max_bytes"}`` (:meth:`Gateway.warm`); stops drafting when the client goes away.
        """
        try:
            tenant = gateway.tenancy.tenant(request.headers)
            body = _parse(WarmDocumentsRequest, await _json(request))
            warmed = await gateway.warm(body, tenant, lambda: client_gone(request))
        except ClientGone:
            gateway.metrics.finished("warm", "disconnected")
            return Response(status_code=499)
        except Exception as error:
            failure = as_gateway_error(error, False)
            gateway.metrics.finished("warm", failure.outcome)
            raise failure from None
        gateway.metrics.finished("warm", "ok")
        return warmed


async def _json(request: Request) -> dict[str, Any]:
    """The body as a JSON object. jiter bounds the nesting depth and the digits of a number, and refuses lone
    surrogates; NaN and Infinity are not JSON.
    """
    try:
        body = pydantic_core.from_json(await request.body(), allow_inf_nan=False)
    except ValueError as error:
        raise bad_request(f"the request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _unknown_model(model: str, served: str) -> GatewayError:
    return GatewayError(
        404,
        f"The model `{echoed(model)}` does not exist; this gateway serves `{served}`",
        "NotFoundError",
        "not_found",
        "model",
    )


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        field, message = first_problem(error)
        raise bad_request(message, field) from None


def _completion_routes(app: FastAPI, gateway: Gateway, settings: GatewaySettings, served: str) -> None:
    tokenizer, protect = gateway.engine.tokenizer, settings.protect_tail_tokens
    context = gateway.engine.backend.context_length

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        layout = lambda body: chat_request_layout(tokenizer, body, protect, context, settings.system_context)  # noqa: E731
        decoding = lambda body, chat: chat_request_decoding(gateway.engine, body, chat)  # noqa: E731
        return await _complete(gateway, request, ChatCompletionRequest, CHAT, layout, served, decoding)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        layout = lambda body: completion_request_layout(gateway.engine, body, context)  # noqa: E731
        return await _complete(gateway, request, CompletionRequest, TEXT, layout, served)


def _no_decoding(body: Any, layout: ChatLayout) -> dict[str, Any]:
    """Text completions: no tools, no output format."""
    return {}


async def _plan(
    gateway: Gateway,
    request: Request,
    schema: type[BaseModel],
    make_layout: Callable[[Any], ChatLayout],
    served: str,
    decoding: DecodingFields = _no_decoding,
) -> tuple[Any, Plan]:
    """Authorize, parse and lay out one request (every failure a :class:`GatewayError`)."""
    started = time.perf_counter()
    body = _parse(schema, await _json(request))
    if body.model != served:
        raise _unknown_model(body.model, served)
    try:
        layout = await asyncio.to_thread(make_layout, body)  # tokenizing 16k tokens would stall every stream
    except SpecPrefillError as error:
        raise as_gateway_error(error, False, body.wire_names) from None
    limit = body.token_limit or max(1, gateway.engine.backend.context_length - len(layout.layout))
    tools = await asyncio.to_thread(decoding, body, layout)
    output = tools.get("output_format")
    # compiled on the grammar workers, not the threads of other requests; tool_choice="auto"'s lazy grammar is
    # compiled as its answer starts instead (falling back to parsing), so busy workers never refuse an auto request
    if output is not None and not output.lazy:
        await gateway.check_output(partial(check_output_format, gateway.engine, body, output), started)
    try:
        params = GenerationParams(
            max_new_tokens=limit,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop_strings,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            **body.logprob_fields,
            **tools,
        )
    except ValidationError as error:
        field, message = first_problem(error)
        raise bad_request(message, field) from None
    return body, Plan(layout, params, body.spec_prefill, started, gateway.tenancy.tenant(request.headers))


async def _complete(
    gateway: Gateway,
    request: Request,
    schema: type[BaseModel],
    api: ApiFormat,
    make_layout: Callable[[Any], ChatLayout],
    served: str,
    decoding: DecodingFields = _no_decoding,
) -> Response:
    endpoint = "chat" if api.is_chat else "completions"
    remote, names = gateway.settings.main_is_remote, WireNames()
    try:
        body, plan = await _plan(gateway, request, schema, make_layout, served, decoding)
        names = body.wire_names
        spent = time.perf_counter() - plan.started  # one deadline from arrival: the grammar's compile counts
        stream = RequestStream(gateway.answer(plan), request, gateway.settings.request_timeout_s, spent)
        try:
            first = await stream.next()
        except BaseException:
            await stream.close()
            raise
    except ClientGone:
        gateway.metrics.finished(endpoint, "disconnected")
        return Response(status_code=499)
    except Exception as error:
        failure = as_gateway_error(error, remote, names)
        gateway.metrics.finished(endpoint, failure.outcome)
        raise failure from None
    writer = ResponseWriter(api, served)
    headers = stats_headers(first.before_first_token(plan, gateway.engine.ran(first.selection))) if first else {}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(gateway, plan, stream, first, writer, include_usage, endpoint)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return await _whole(gateway, plan, stream, first, writer, endpoint, headers)


async def _whole(
    gateway: Gateway,
    plan: Plan,
    stream: RequestStream,
    first: Answer | None,
    writer: ResponseWriter,
    endpoint: str,
    headers: dict[str, str],
) -> Response:
    texts, final, answer = [], None, first
    calls: list[ToolCall] = []
    try:
        while answer is not None:
            texts.append(answer.chunk.text)
            calls.extend(answer.chunk.tool_calls)
            final = answer if answer.chunk.stats is not None else final
            answer = await stream.next()
    except ClientGone:
        gateway.metrics.finished(endpoint, "disconnected")
        return Response(status_code=499)
    except Exception as error:
        failure = as_gateway_error(error, gateway.settings.main_is_remote)
        gateway.metrics.finished(endpoint, failure.outcome)
        return JSONResponse(failure.body(), status_code=failure.status, headers=failure.headers)
    finally:
        await stream.close()
    assert final is not None and final.chunk.stats is not None  # the engine's last chunk carries the stats
    gateway.metrics.finished(endpoint, "ok", final.chunk.stats)
    stats, spec_prefill = final.chunk.stats, with_invalid_calls(final.spec_prefill(plan), final.chunk, plan.params)
    assert final.chunk.result is not None  # and the result
    reason, logprobs = final.chunk.finish_reason or "stop", final.chunk.result.logprobs
    body = writer.whole("".join(texts), reason, stats, spec_prefill or {}, calls, logprobs)
    return JSONResponse(body, headers=headers)


async def _events(
    gateway: Gateway,
    plan: Plan,
    stream: RequestStream,
    first: Answer | None,
    writer: ResponseWriter,
    include_usage: bool,
    endpoint: str,
) -> AsyncIterator[bytes]:
    """The SSE body: chunks, the stats in the last one, ``[DONE]``; an error after the first chunk
    becomes an ``error`` event (the status line is already sent).
    """
    outcome, stats, answer, is_first, calls = "disconnected", None, first, True, 0
    try:
        while answer is not None:
            chunk = answer.chunk
            spec_prefill = with_invalid_calls(answer.spec_prefill(plan), chunk, plan.params)
            choice = (chunk.text, is_first, chunk.finish_reason, spec_prefill, chunk.tool_calls, calls, chunk.logprobs)
            yield sse(writer.chunk(*choice))
            calls += len(chunk.tool_calls)
            if chunk.stats is not None and spec_prefill is not None:
                stats = chunk.stats
                if include_usage:
                    yield sse(writer.usage_chunk(chunk.stats, spec_prefill))
            is_first = False
            answer = await stream.next()
        yield sse("[DONE]")
        outcome = "ok"
    except ClientGone:
        pass
    except Exception as error:
        failure = as_gateway_error(error, gateway.settings.main_is_remote)
        outcome = failure.outcome
        log.warning("request failed mid-stream: %s", failure.message)
        yield sse(failure.body())
        yield sse("[DONE]")
    finally:
        gateway.metrics.finished(endpoint, outcome, stats if outcome == "ok" else None)
        with anyio.CancelScope(shield=True):  # Starlette cancels this task when the client disconnects
            await stream.close()
