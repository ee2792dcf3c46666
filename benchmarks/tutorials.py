"""The frameworks' own RAG tutorial chains on the real pair: how much of the retrieved text is kept (issue #29, part 5).

Each pattern is the tutorial's code, unchanged but for the model: no SpecPrefill helper, marker or
``documents=``. In-process, LangChain's ``ChatSpecPrefill`` finds the documents a retriever returned in the
same run (``retriever-located``) and LlamaIndex's ``SpecPrefillLLM`` gets the chat engine's nodes
(``argument-located``). Through the gateway (``specprefill-rag serve``'s app, run in this process on
127.0.0.1 over the same models), LangChain's ``ChatOpenAI`` and LlamaIndex's ``OpenAILike`` send the context
as plain text in the system message and ask for ``"spec_prefill": {"system_context": "delimited"}`` in the
request body (``system-context``).

Patterns (the retriever: the five articles of ``examples/documents`` with all-MiniLM-L6-v2 embeddings from
its PyPI package, top-4, built as ``examples/langchain_rag.py`` and ``examples/llamaindex_rag.py`` build it):

* ``lc-rag-tutorial``: ``{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm``,
  the tutorial's QA prompt with the context in the system message;
* ``lc-retrieval-chain``: ``create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))``
  (langchain_classic) with the LangChain docs' QA prompt (``... Context: {context}``);
* ``lc-history-aware``: ``create_history_aware_retriever`` + ``create_retrieval_chain``, one earlier turn in
  the chat history (the rephrasing call comes first; the row is the answering call);
* ``li-context`` and ``li-condense-plus-context``: ``index.as_chat_engine(chat_mode=..., similarity_top_k=4)``
  (``condense_plus_context`` with the same earlier turn, so its condensing call runs first).

Each pattern runs with the 0.5B draft and with ``self`` (the main model's first 40% of layers: what no draft
named means in-process; named explicitly here, because leaving it unnamed raised a TypeError in
``SpecPrefillConfig.with_default_draft`` when this was measured). Settings:
the adapters' documented ones (``keep_rate=0.3``, 32 new tokens), everything else default, so
``min_prompt_tokens`` is ``"auto"`` (the length from which the draft pays for this pair).

    python benchmarks/tutorials.py                                  # every pattern, both drafts
    python benchmarks/tutorials.py --drafts self --patterns lc-rag-tutorial --surfaces in-process
    python benchmarks/tutorials.py --resume                         # skip the runs the file has

Writes ``<out>.json`` (every record) and ``<out>.md`` (the table) after every run. Token counts and kept
shares are deterministic (greedy); TTFT is indicative only on a shared CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from specprefill_rag.testing import LANGCHAIN_RETRIEVAL_CHAIN, LANGCHAIN_TUTORIAL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

MAIN = "qwen2.5-coder-1.5b"
DRAFTS = ["qwen2.5-coder-0.5b", "self"]  # "self": what no draft named means in-process (named here: see Surfaces)
SURFACES = ["in-process", "gateway"]
PATTERNS = ["lc-rag-tutorial", "lc-retrieval-chain", "lc-history-aware", "li-context", "li-condense-plus-context"]
QUESTION = "In what year was the Rosetta Stone found?"
EXPECTED = "1799"
HISTORY = [
    ("What is the Rosetta Stone?", "An ancient Egyptian stone slab inscribed with one decree in three scripts."),
]
DELIMITED = {"spec_prefill": {"system_context": "delimited"}}

# the tutorial's history-aware retriever prompt
CONTEXTUALIZE = (
    "Given a chat history and the latest user question which might reference context in the chat history, "
    "formulate a standalone question which can be understood without the chat history. Do NOT answer the "
    "question, just reformulate it if needed and otherwise return it as is."
)

FIELDS = (
    "prompt_tokens",
    "document_tokens",
    "kept_tokens",
    "kept_document_tokens",
    "keep_rate",
    "compressed",
    "uncompressed_reason",
    "document_source",
    "n_documents",
    "draft_path",
    "draft_ms",
    "draft_cached_tokens",
    "ttft_ms",
)


# -- stats where each surface leaves them ------------------------------------------------------------


def langchain_stats_handler() -> Any:
    from langchain_core.callbacks import BaseCallbackHandler

    class Stats(BaseCallbackHandler):
        """The spec_prefill stats of every ChatSpecPrefill call in a run (chains ending in a parser drop them)."""

        def __init__(self) -> None:
            self.calls: list[dict] = []

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            self.calls.append(response.generations[0][0].message.response_metadata.get("spec_prefill") or {})

    return Stats()


class LlamaStats:
    """The spec_prefill stats of every SpecPrefillLLM chat call (LlamaIndex's instrumentation events)."""

    def __init__(self) -> None:
        from llama_index.core.instrumentation import get_dispatcher
        from llama_index.core.instrumentation.event_handlers import BaseEventHandler
        from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

        calls: list[dict] = []

        class Handler(BaseEventHandler):
            def handle(self, event: Any, **kwargs: Any) -> None:
                if isinstance(event, LLMChatEndEvent) and event.response is not None:
                    raw = event.response.raw
                    if isinstance(raw, dict) and "spec_prefill" in raw:
                        calls.append(raw["spec_prefill"])

        self.calls = calls
        get_dispatcher().add_event_handler(Handler())


class HttpStats:
    """An httpx client that keeps each chat completion's ``spec_prefill`` object (the OpenAI clients drop it)."""

    def __init__(self) -> None:
        import httpx

        self.calls: list[dict] = []
        self.client = httpx.Client(event_hooks={"response": [self._record]}, timeout=600)

    def _record(self, response: Any) -> None:
        streaming = response.headers.get("content-type", "").startswith("text/event-stream")
        if response.request.url.path.endswith("/chat/completions") and not streaming:
            response.read()
            self.calls.append(response.json().get("spec_prefill") or {})


# -- the patterns, as the tutorials write them --------------------------------------------------------


def format_docs(docs: list) -> str:  # the tutorial's own: no markers
    return "\n\n".join(doc.page_content for doc in docs)


def lc_history() -> list:
    from langchain_core.messages import AIMessage, HumanMessage

    return [m for q, a in HISTORY for m in (HumanMessage(q), AIMessage(a))]


def run_langchain(pattern: str, llm: Any, retriever: Any, question: str) -> tuple[str, dict]:
    """(the answer, the invoke config's callbacks) of one LangChain tutorial chain."""
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables import RunnablePassthrough

    stats = langchain_stats_handler()
    config = {"callbacks": [stats]}
    if pattern == "lc-rag-tutorial":
        prompt = ChatPromptTemplate.from_messages([("system", LANGCHAIN_TUTORIAL), ("human", "{question}")])
        rag_chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
        answer = str(rag_chain.invoke(question, config=config).content)
    elif pattern == "lc-retrieval-chain":
        from langchain_classic.chains import create_retrieval_chain
        from langchain_classic.chains.combine_documents import create_stuff_documents_chain

        prompt = ChatPromptTemplate.from_messages([("system", LANGCHAIN_RETRIEVAL_CHAIN), ("human", "{input}")])
        rag_chain = create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))
        answer = rag_chain.invoke({"input": question}, config=config)["answer"]
    elif pattern == "lc-history-aware":
        from langchain_classic.chains import create_history_aware_retriever, create_retrieval_chain
        from langchain_classic.chains.combine_documents import create_stuff_documents_chain

        contextualize_q_prompt = ChatPromptTemplate.from_messages(
            [("system", CONTEXTUALIZE), MessagesPlaceholder("chat_history"), ("human", "{input}")]
        )
        history_aware_retriever = create_history_aware_retriever(llm, retriever, contextualize_q_prompt)
        qa_prompt = ChatPromptTemplate.from_messages(
            [("system", LANGCHAIN_TUTORIAL), MessagesPlaceholder("chat_history"), ("human", "{input}")]
        )
        rag_chain = create_retrieval_chain(history_aware_retriever, create_stuff_documents_chain(llm, qa_prompt))
        answer = rag_chain.invoke({"input": question, "chat_history": lc_history()}, config=config)["answer"]
    else:
        raise ValueError(pattern)
    return answer, stats


def run_llama_index(pattern: str, llm: Any, index: Any, question: str) -> str:
    from llama_index.core.llms import ChatMessage

    if pattern == "li-context":
        chat_engine = index.as_chat_engine(chat_mode="context", llm=llm, similarity_top_k=4)
        return str(chat_engine.chat(question).response)
    if pattern == "li-condense-plus-context":
        chat_engine = index.as_chat_engine(chat_mode="condense_plus_context", llm=llm, similarity_top_k=4)
        history = [
            m
            for q, a in HISTORY
            for m in (ChatMessage(role="user", content=q), ChatMessage(role="assistant", content=a))
        ]
        return str(chat_engine.chat(question, chat_history=history).response)
    raise ValueError(pattern)


# -- the models on each surface ------------------------------------------------------------------------


class Surfaces:
    """The LLM objects of one draft: the adapters in-process, ChatOpenAI/OpenAILike to a gateway."""

    def __init__(
        self,
        draft: str,
        keep_rate: float,
        max_tokens: int,
        min_prompt_tokens: int | str = "auto",
        engine_settings: dict[str, Any] | None = None,
    ) -> None:
        self.draft = draft
        self.min_prompt_tokens = min_prompt_tokens
        self.engine_settings = engine_settings or {}  # more engine settings, on every surface (e.g. chunking)
        # "self" is named explicitly: the adapters' and the gateway's unnamed default (draft None, meant to become
        # "self") raised TypeError in SpecPrefillConfig.with_default_draft when this was measured (see the page)
        self.draft_model = draft
        self.keep_rate = keep_rate
        self.max_tokens = max_tokens
        self._server: Any = None
        self.url: str | None = None
        self.gateway_engine: Any = None

    def langchain_in_process(self) -> Any:
        from langchain_specprefill import ChatSpecPrefill

        return ChatSpecPrefill(
            model=MAIN,
            draft_model=self.draft_model,
            keep_rate=self.keep_rate,
            max_tokens=self.max_tokens,
            min_prompt_tokens=self.min_prompt_tokens,
            **self.engine_settings,
        )

    def llama_in_process(self) -> Any:
        from llama_index.llms.specprefill import SpecPrefillLLM

        return SpecPrefillLLM(
            model=MAIN,
            draft_model=self.draft_model,
            keep_rate=self.keep_rate,
            max_new_tokens=self.max_tokens,
            min_prompt_tokens=self.min_prompt_tokens,
            **self.engine_settings,
        )

    def start_gateway(self) -> str:
        """``specprefill-rag serve --main MAIN [--draft DRAFT] --keep-rate K``'s app on 127.0.0.1 (models shared
        with the in-process engines: one copy of the weights)."""
        if self.url is None:
            from specprefill_rag.serve import GatewaySettings, create_app
            from specprefill_rag.serve.server import BackgroundServer

            settings = GatewaySettings(
                main=MAIN,
                draft=self.draft_model,
                keep_rate=self.keep_rate,
                min_prompt_tokens=self.min_prompt_tokens,
                **self.engine_settings,
            )
            app = create_app(settings)
            self.gateway_engine = app.state.gateway.engine
            self._server = BackgroundServer(app, start_timeout_s=600)
            self.url = self._server.__enter__()
        return self.url

    def stop_gateway(self) -> None:
        if self._server is not None:
            self._server.__exit__(None, None, None)
            self._server = self.url = None

    def chat_openai(self, http: HttpStats) -> Any:
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(
            base_url=self.start_gateway() + "/v1",
            api_key="unused",
            model=MAIN,
            temperature=0,
            max_tokens=self.max_tokens,
            max_retries=0,
            timeout=600,
            http_client=http.client,
            extra_body=DELIMITED,
        )

    def openai_like(self, http: HttpStats) -> Any:
        from llama_index.llms.openai_like import OpenAILike

        return OpenAILike(
            api_base=self.start_gateway() + "/v1",
            api_key="unused",
            model=MAIN,
            is_chat_model=True,
            temperature=0,
            max_tokens=self.max_tokens,
            context_window=32768,
            max_retries=0,
            timeout=600,
            http_client=http.client,
            additional_kwargs={"extra_body": DELIMITED},
        )


def one_run(pattern: str, surface: str, models: Surfaces, retrieval: dict, question: str) -> dict:
    """One pattern on one surface: the answering call's stats, the calls before it, the answer."""
    started = time.perf_counter()
    if surface == "in-process":
        if pattern.startswith("lc-"):
            answer, stats = run_langchain(pattern, models.langchain_in_process(), retrieval["langchain"], question)
            calls = stats.calls
        else:
            log = retrieval["llama_stats"]
            before = len(log.calls)
            answer = run_llama_index(pattern, models.llama_in_process(), retrieval["llama_index"], question)
            calls = log.calls[before:]
    else:
        http = HttpStats()
        if pattern.startswith("lc-"):
            answer, _ = run_langchain(pattern, models.chat_openai(http), retrieval["langchain"], question)
        else:
            answer = run_llama_index(pattern, models.openai_like(http), retrieval["llama_index"], question)
        calls = http.calls
    wall_s = time.perf_counter() - started
    if not calls:
        raise RuntimeError(f"{pattern} on {surface}: no spec_prefill stats were recorded")
    last = calls[-1]
    return {
        "pattern": pattern,
        "surface": surface,
        "draft": models.draft,
        **{name: last.get(name) for name in FIELDS},
        "calls": len(calls),
        "earlier_calls": [{name: call.get(name) for name in FIELDS} for call in calls[:-1]],
        "answer": answer,
        "answer_ok": EXPECTED.lower() in answer.lower(),
        "wall_s": round(wall_s, 2),
    }


def build_retrieval() -> dict:
    """The examples' retrievers over examples/documents (all-MiniLM-L6-v2, top-4), and the LlamaIndex stats log."""
    import langchain_rag
    import llamaindex_rag

    return {
        "langchain": langchain_rag.build_retriever(k=4),
        "llama_index": llamaindex_rag.build_index(),
        "llama_stats": LlamaStats(),
    }


# -- the report ----------------------------------------------------------------------------------------

LABELS = {
    "lc-rag-tutorial": "LangChain RAG tutorial LCEL chain",
    "lc-retrieval-chain": "LangChain `create_stuff_documents_chain` + `create_retrieval_chain`",
    "lc-history-aware": "LangChain `create_history_aware_retriever` + `create_retrieval_chain`",
    "li-context": "LlamaIndex `context` chat engine",
    "li-condense-plus-context": "LlamaIndex `condense_plus_context` chat engine",
}


def compressed_cell(run: dict) -> str:
    return "yes" if run["compressed"] else f"no: `{run['uncompressed_reason']}`"


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"Main {meta['main']}, keep_rate {meta['keep_rate']}, {meta['max_tokens']} new tokens, top-{meta['top_k']} "
        f"retrieval; question {meta['question']!r} (expected {meta['expected']!r}). "
        f"min_prompt_tokens 'auto' resolved to: "
        + ", ".join(f"{d}: {n}" for d, n in meta.get("min_prompt_tokens", {}).items())
        + f". Machine: {meta['machine']}; {meta['date']}.",
        "",
        "| pattern | surface | draft | document_source | prompt tokens | documents' tokens | kept document tokens "
        "| kept share | compressed | answer ok | TTFT ms (indicative) |",
        "|---|---|---|---|---:|---:|---:|---:|---|---|---:|",
    ]
    order = {(p, s, d): i for i, (s, p, d) in enumerate(plan(PATTERNS, SURFACES, DRAFTS))}
    for run in sorted(report["runs"], key=lambda r: order.get((r["pattern"], r["surface"], r["draft"]), 1e9)):
        share = run["kept_document_tokens"] / run["document_tokens"] if run["document_tokens"] else 1.0
        lines.append(
            f"| {LABELS.get(run['pattern'], run['pattern'])} | {run['surface']} | {run['draft']} "
            f"| {run['document_source']} | {run['prompt_tokens']:,} | {run['document_tokens']:,} "
            f"| {run['kept_document_tokens']:,} | {share:.2f} | {compressed_cell(run)} "
            f"| {'yes' if run['answer_ok'] else 'no'} | {run['ttft_ms']:,.0f} |"
        )
    earlier = [r for r in report["runs"] if r["earlier_calls"]]
    if earlier:
        lines += ["", "Calls before the answering one (the rephrasing / condensing call):", ""]
        for run in earlier:
            for call in run["earlier_calls"]:
                lines.append(
                    f"* {run['pattern']}, {run['surface']}, {run['draft']}: {call['prompt_tokens']} prompt tokens, "
                    f"document_source {call['document_source']}, "
                    f"{'compressed' if call['compressed'] else 'not compressed: ' + str(call['uncompressed_reason'])}"
                )
    return "\n".join(lines) + "\n"


def plan(patterns: list[str], surfaces: list[str], drafts: list[str]) -> list[tuple[str, str, str]]:
    """(surface, pattern, draft), grouped by draft so each draft's gateway starts once."""
    return [(s, p, d) for d in drafts for s in surfaces for p in patterns]


def machine() -> str:
    import torch
    from ttft import cpu_model

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    threads = f"{os.cpu_count()} CPU threads ({torch.get_num_threads()} used by torch)"
    return f"{cpu_model()}, {threads}, torch {torch.__version__}"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tutorials" / "run"))
    options.add_argument("--drafts", nargs="+", default=DRAFTS, help="draft specs; 'self' = no draft named")
    options.add_argument("--patterns", nargs="+", default=PATTERNS, choices=PATTERNS)
    options.add_argument("--surfaces", nargs="+", default=SURFACES, choices=SURFACES)
    options.add_argument("--keep-rate", type=float, default=0.3)
    options.add_argument("--max-tokens", type=int, default=32)
    options.add_argument("--question", default=QUESTION)
    options.add_argument("--resume", action="store_true", help="keep the runs a previous run wrote")
    args = options.parse_args()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_suffix(".json")
    meta = {
        "main": MAIN,
        "keep_rate": args.keep_rate,
        "max_tokens": args.max_tokens,
        "top_k": 4,
        "question": args.question,
        "expected": EXPECTED,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "min_prompt_tokens": {},
    }
    report = json.loads(path.read_text()) if args.resume and path.exists() else {"meta": meta, "runs": []}
    report["meta"] = {**meta, "min_prompt_tokens": report["meta"].get("min_prompt_tokens", {})}
    done = {(r["pattern"], r["surface"], r["draft"]) for r in report["runs"]}

    retrieval = build_retrieval()
    surfaces: dict[str, Surfaces] = {}
    try:
        for surface, pattern, draft in plan(args.patterns, args.surfaces, args.drafts):
            if (pattern, surface, draft) in done:
                continue
            if draft not in surfaces:
                for other in surfaces.values():
                    other.stop_gateway()
                surfaces[draft] = Surfaces(draft, args.keep_rate, args.max_tokens)
            run = one_run(pattern, surface, surfaces[draft], retrieval, args.question)
            engine = surfaces[draft].gateway_engine
            if engine is None and surface == "in-process":
                engine = surfaces[draft].langchain_in_process().engine
            if engine is not None:
                report["meta"]["min_prompt_tokens"][draft] = engine.min_prompt_tokens
            report["runs"].append(run)
            path.write_text(json.dumps(report, indent=1))
            out.with_suffix(".md").write_text(markdown(report))
            print(
                f"{pattern:26} {surface:10} {draft:20} {run['document_source']:18} "
                f"{run['kept_document_tokens']}/{run['document_tokens']} of {run['prompt_tokens']} "
                f"{compressed_cell(run)} ok={run['answer_ok']} {run['wall_s']} s: {run['answer'][:60]!r}",
                flush=True,
            )
    finally:
        for models in surfaces.values():
            models.stop_gateway()


if __name__ == "__main__":
    main()
