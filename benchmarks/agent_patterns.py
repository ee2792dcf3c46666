"""The frameworks' agent patterns on the real pair, as their tutorials write them (issue #45, part 4).

Each pattern is an agent with one retriever tool, ``retrieve_context(query)``, over the five articles of
``examples/documents`` (all-MiniLM-L6-v2 embeddings, the ``--k`` best chunks, built as ``examples/langchain_rag.py``
and ``examples/llamaindex_rag.py`` build them), asked one question, with ``tool_choice`` left to the framework
(``"auto"``: nothing is forced). In-process the models are ``ChatSpecPrefill`` and ``SpecPrefillLLM``; through
the gateway (``specprefill-rag serve``'s app in this process on 127.0.0.1, the same models) LangChain's
``ChatOpenAI`` and LlamaIndex's ``OpenAILike``. Patterns:

* ``lc-create-agent``: ``langchain.agents.create_agent(llm, tools=[retrieve_context], system_prompt=...)``;
* ``lg-react-agent``: ``langgraph.prebuilt.create_react_agent(llm, [retrieve_context], prompt=...,
  checkpointer=InMemorySaver())`` with a ``thread_id``;
* ``lc-bind-tools``: ``llm.bind_tools([retrieve_context])`` in a loop that appends each ``ToolMessage``;
* ``lc-astream-events``: ``create_agent``'s ``astream_events(version="v2")``, the answer read from the events;
* ``li-function-agent``: ``FunctionAgent(tools=[retrieve_context], llm=llm, system_prompt=...).run(question)``;
* ``li-agent-workflow``: ``AgentWorkflow.from_tools_or_functions([retrieve_context], llm=llm, ...)``.

Per run: whether it ran (no exception), the tool's calls, the model calls, how many model calls had tool
results in their prompt and how many of those were compressed, whether the tool's results held the expected
text (else no answer can be right: LangChain's agentic RAG tutorial returns the 2 best chunks, and for the
default question the chunk with the answer ranks third, so ``--k`` defaults to 4, the retrievers' default and
the tutorials study's), and whether the answer holds it, anywhere and in its last line (an answer that quotes
the right year and concludes another is wrong). Stats come from each surface's own place (LangChain
callbacks, LlamaIndex instrumentation, the gateway's ``x-specprefill-*`` response headers).
``--min-prompt-tokens`` is 0 by default: the tool results here are a few hundred tokens, under the pair's
automatic floor (1,152), which would leave every prompt whole. With ``--k 8 --min-prompt-tokens auto`` the tool
returns about 2,000 tokens and the engine's defaults compress them.

    python benchmarks/agent_patterns.py                       # every pattern, both surfaces
    python benchmarks/agent_patterns.py --patterns li-function-agent --surfaces gateway
    python benchmarks/agent_patterns.py --system "..."        # another system prompt
    python benchmarks/agent_patterns.py --resume              # skip the runs the file has
    python benchmarks/agent_patterns.py --report --out ...    # rewrite <out>.md from <out>.json

Writes ``<out>.json`` and ``<out>.md`` after every run. TTFT is not reported: the table is about behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tutorials  # noqa: E402

PATTERNS = [
    "lc-create-agent",
    "lg-react-agent",
    "lc-bind-tools",
    "lc-astream-events",
    "li-function-agent",
    "li-agent-workflow",
]
SURFACES = ["in-process", "gateway"]
# LangChain's agentic RAG tutorial's system prompt, with its blog post made the example articles
SYSTEM = (
    "You have access to a tool that retrieves context from a set of articles. Use the tool to help answer user queries."
)
QUESTION = tutorials.QUESTION
EXPECTED = tutorials.EXPECTED
HEADERS = {
    "compressed": "x-specprefill-compressed",
    "uncompressed_reason": "x-specprefill-uncompressed-reason",
    "prompt_tokens": "x-specprefill-prompt-tokens",
    "document_tokens": "x-specprefill-document-tokens",
    "kept_document_tokens": "x-specprefill-kept-document-tokens",
    "document_source": "x-specprefill-document-source",
}
LABELS = {
    "lc-create-agent": "LangChain `create_agent` + retriever tool",
    "lg-react-agent": "LangGraph `create_react_agent` + checkpointer",
    "lc-bind-tools": "LangChain `bind_tools` loop with `ToolMessage`s",
    "lc-astream-events": "LangChain `create_agent`, `astream_events`",
    "li-function-agent": "LlamaIndex `FunctionAgent`",
    "li-agent-workflow": "LlamaIndex `AgentWorkflow`",
}


class HeaderStats:
    """An httpx client that keeps the stats headers of every chat completion, streamed or not."""

    def __init__(self) -> None:
        import httpx

        self.calls: list[dict] = []
        self.client = httpx.Client(event_hooks={"response": [self._record]}, timeout=600)
        self.async_client = httpx.AsyncClient(event_hooks={"response": [self._arecord]}, timeout=600)

    def _stats(self, response: Any) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            self.calls.append({name: response.headers.get(header) for name, header in HEADERS.items()})

    def _record(self, response: Any) -> None:
        self._stats(response)

    async def _arecord(self, response: Any) -> None:
        self._stats(response)


class Tool:
    """The retriever tool's searches and results, and its text for a query (the ``k`` best chunks)."""

    def __init__(self, retrieval: dict, k: int) -> None:
        self.store = retrieval["langchain"].vectorstore
        self.k = k
        self.queries: list[str] = []
        self.results: list[str] = []

    def retrieve(self, query: str) -> str:
        self.queries.append(query)
        docs = self.store.similarity_search(query, k=self.k)
        self.results.append("\n\n".join(f"Source: {doc.metadata}\nContent: {doc.page_content}" for doc in docs))
        return self.results[-1]

    def langchain(self) -> Any:
        from langchain_core.tools import tool

        @tool
        def retrieve_context(query: str) -> str:
            """Retrieve information to help answer a query."""
            return self.retrieve(query)

        return retrieve_context

    def llama_index(self) -> Any:
        from llama_index.core.tools import FunctionTool

        def retrieve_context(query: str) -> str:
            """Retrieve information to help answer a query."""
            return self.retrieve(query)

        return FunctionTool.from_defaults(fn=retrieve_context)


def run_langchain(pattern: str, llm: Any, tool: Tool, system: str, question: str, config: dict) -> str:
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    retrieve_context = tool.langchain()
    inputs = {"messages": [{"role": "user", "content": question}]}
    if pattern == "lc-create-agent":
        agent = create_agent(llm, tools=[retrieve_context], system_prompt=system)
        return str(agent.invoke(inputs, config)["messages"][-1].content)
    if pattern == "lg-react-agent":
        from langgraph.checkpoint.memory import InMemorySaver
        from langgraph.prebuilt import create_react_agent

        agent = create_react_agent(llm, [retrieve_context], prompt=system, checkpointer=InMemorySaver())
        threaded = {**config, "configurable": {"thread_id": "1"}}
        return str(agent.invoke(inputs, threaded)["messages"][-1].content)
    if pattern == "lc-bind-tools":
        bound = llm.bind_tools([retrieve_context])
        messages: list[Any] = [SystemMessage(system), HumanMessage(question)]
        for _ in range(4):
            answer = bound.invoke(messages, config)
            messages.append(answer)
            if not answer.tool_calls:
                break
            for call in answer.tool_calls:
                messages.append(ToolMessage(retrieve_context.invoke(call["args"]), tool_call_id=call["id"]))
        return str(messages[-1].content)
    if pattern == "lc-astream-events":
        agent = create_agent(llm, tools=[retrieve_context], system_prompt=system)

        async def events() -> str:
            last = ""
            async for event in agent.astream_events(inputs, config, version="v2"):
                if event["event"] == "on_chat_model_end":
                    last = str(event["data"]["output"].content)
            return last

        return asyncio.run(events())
    raise ValueError(pattern)


def run_llama_index(pattern: str, llm: Any, tool: Tool, system: str, question: str) -> str:
    from llama_index.core.agent.workflow import AgentWorkflow, FunctionAgent

    async def run(workflow: Any, **inputs: Any) -> str:  # a workflow starts its tasks on the running loop
        return str(await workflow.run(**inputs))

    if pattern == "li-function-agent":
        agent = FunctionAgent(tools=[tool.llama_index()], llm=llm, system_prompt=system)
        return asyncio.run(run(agent, user_msg=question))
    if pattern == "li-agent-workflow":
        workflow = AgentWorkflow.from_tools_or_functions([tool.llama_index()], llm=llm, system_prompt=system)
        return asyncio.run(run(workflow, user_msg=question))
    raise ValueError(pattern)


def gateway_llm(models: tutorials.Surfaces, framework: str, http: HeaderStats) -> Any:
    url = models.start_gateway() + "/v1"
    if framework == "lc":
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(
            base_url=url,
            api_key="unused",
            model=tutorials.MAIN,
            temperature=0,
            max_tokens=models.max_tokens,
            max_retries=0,
            timeout=600,
            http_client=http.client,
            http_async_client=http.async_client,
        )
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(
        api_base=url,
        api_key="unused",
        model=tutorials.MAIN,
        is_chat_model=True,
        is_function_calling_model=True,
        temperature=0,
        max_tokens=models.max_tokens,
        context_window=32768,
        max_retries=0,
        timeout=600,
        http_client=http.client,
        async_http_client=http.async_client,
    )


def flag(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def count(value: Any) -> int:
    return int(value) if value not in (None, "") else 0


def one_run(pattern: str, surface: str, models: tutorials.Surfaces, retrieval: dict, args: argparse.Namespace) -> dict:
    """One pattern on one surface: ran, tool calls, model calls, compressed calls after tool results, answer."""
    tool = Tool(retrieval, args.k)
    framework = pattern.split("-")[0]
    started = time.perf_counter()
    error = None
    answer = ""
    log = retrieval["llama_stats"]
    before = len(log.calls)
    http = HeaderStats()
    stats = tutorials.langchain_stats_handler()
    try:
        if surface == "in-process":
            llm = models.langchain_in_process() if framework in ("lc", "lg") else models.llama_in_process()
        else:
            llm = gateway_llm(models, "lc" if framework in ("lc", "lg") else "li", http)
        if framework in ("lc", "lg"):
            answer = run_langchain(pattern, llm, tool, args.system, args.question, {"callbacks": [stats]})
        else:
            answer = run_llama_index(pattern, llm, tool, args.system, args.question)
    except Exception as exc:  # a pattern that fails is a row of the table, not the end of the study
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    if surface == "gateway":
        calls = http.calls
    elif framework in ("lc", "lg"):
        calls = stats.calls
    else:
        calls = log.calls[before:]
    with_results = [c for c in calls if count(c.get("document_tokens")) > 0]
    return {
        "pattern": pattern,
        "surface": surface,
        "ran": error is None,
        "error": error,
        "tool_calls": len(tool.queries),
        "queries": tool.queries,
        "model_calls": len(calls),
        "calls_with_results": len(with_results),
        "compressed": sum(flag(c.get("compressed")) for c in with_results),
        "reasons": sorted({str(c.get("uncompressed_reason")) for c in calls if not flag(c.get("compressed"))}),
        "calls": calls,
        "answer_retrieved": any(EXPECTED.lower() in result.lower() for result in tool.results),
        "answer": answer,
        "answer_ok": EXPECTED.lower() in answer.lower(),
        "wall_s": round(time.perf_counter() - started, 2),
    }


def last_line(answer: str) -> str:
    """The answer's last non-empty line ("" for an empty answer)."""
    return next((line for line in reversed(answer.splitlines()) if line.strip()), "")


def final_line_ok(answer: str) -> bool:
    """Whether the answer's last non-empty line holds the expected text: an answer that quotes the right year
    from the context and then concludes another holds it, but is wrong."""
    return EXPECTED.lower() in last_line(answer).lower()


def stopped_at_limit(run: dict, max_tokens: int) -> bool | None:
    """Whether the answer's model call wrote its whole token allowance (the answer was cut, not concluded); None
    where the surface does not report completion tokens (the gateway's headers)."""
    tokens = run["calls"][-1].get("completion_tokens") if run["calls"] else None
    return None if tokens is None else int(tokens) >= max_tokens


def concluded_ok(run: dict, max_tokens: int) -> bool:
    """The answer's last line holds the expected text and the answer was not cut at the token limit: a
    one-line answer that quotes the year and then repeats a phrase to the limit concludes nothing."""
    return final_line_ok(run["answer"]) and not stopped_at_limit(run, max_tokens)


def retrieved_cell(run: dict) -> str:
    if "answer_retrieved" not in run:  # runs recorded before the tool kept its results
        return "not recorded"
    return "yes" if run["answer_retrieved"] else "no"


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"Main {meta['main']}, draft {meta['draft']}, keep_rate {meta['keep_rate']}, chunking "
        f"{meta.get('chunking', 'tokens')}, min_prompt_tokens "
        f"{meta['min_prompt_tokens']}, {meta['max_tokens']} new tokens per model call, the tool returns the "
        f"{meta.get('k', 2)} best chunks, tool_choice left to the "
        f"framework; question {meta['question']!r} (expected {meta['expected']!r}); system prompt "
        f"{meta['system']!r}. Machine: {meta['machine']}; {meta['date']}.",
        "",
        "| pattern | surface | ran | tool calls | model calls | calls with tool results: compressed "
        "| answer in tool results | answer ok | its last line ok, not cut | cut at the token limit "
        "| not compressed because | answer's last line |",
        "|---|---|---|---:|---:|---|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        answer = " ".join(last_line(run["answer"]).split()).replace("|", "\\|")[-80:]
        ran = "yes" if run["ran"] else f"no: {run['error'][:80]}"
        cut = {None: "not reported", True: "yes", False: "no"}[stopped_at_limit(run, meta["max_tokens"])]
        lines.append(
            f"| {LABELS[run['pattern']]} | {run['surface']} | {ran} | {run['tool_calls']} | {run['model_calls']} "
            f"| {run['compressed']} of {run['calls_with_results']} | {retrieved_cell(run)} "
            f"| {'yes' if run['answer_ok'] else 'no'} | {'yes' if concluded_ok(run, meta['max_tokens']) else 'no'} "
            f"| {cut} | {', '.join(run['reasons']) or '-'} | {answer} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agent-patterns" / "run"))
    options.add_argument("--main", default=tutorials.MAIN)
    options.add_argument("--draft", default=tutorials.DRAFTS[0])
    options.add_argument("--patterns", nargs="+", default=PATTERNS, choices=PATTERNS)
    options.add_argument("--surfaces", nargs="+", default=SURFACES, choices=SURFACES)
    options.add_argument("--keep-rate", type=float, default=0.3)
    options.add_argument("--k", type=int, default=4, help="chunks the retriever tool returns per search")
    options.add_argument(
        "--min-prompt-tokens",
        type=lambda value: value if value == "auto" else int(value),
        default=0,
        help="a number, or 'auto': the engine's default, the length from which the draft pays for this pair",
    )
    options.add_argument("--max-tokens", type=int, default=96)
    options.add_argument("--chunking", default="tokens", choices=["tokens", "sentences"], help="the engine's chunking")
    options.add_argument("--question", default=QUESTION)
    options.add_argument("--system", default=SYSTEM)
    options.add_argument("--resume", action="store_true", help="keep the runs a previous run with these settings wrote")
    options.add_argument("--report", action="store_true", help="rewrite <out>.md from <out>.json; run nothing")
    args = options.parse_args()
    if args.report:
        out = Path(args.out)
        out.with_suffix(".md").write_text(markdown(json.loads(out.with_suffix(".json").read_text())))
        return
    tutorials.MAIN = args.main  # the surfaces build their models from it

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "meta": {
            "main": args.main,
            "draft": args.draft,
            "keep_rate": args.keep_rate,
            "min_prompt_tokens": args.min_prompt_tokens,
            "chunking": args.chunking,
            "max_tokens": args.max_tokens,
            "k": args.k,
            "question": args.question,
            "expected": EXPECTED,
            "system": args.system,
            "machine": tutorials.machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        },
        "runs": [],
    }
    path = out.with_suffix(".json")
    if args.resume and path.exists():
        earlier = json.loads(path.read_text())
        same = ("main", "draft", "keep_rate", "min_prompt_tokens", "chunking", "max_tokens", "k", "question", "system")
        before = {"k": 2, "chunking": "tokens"}  # what runs from before a setting was recorded used
        if any(earlier["meta"].get(key, before.get(key)) != report["meta"][key] for key in same):
            raise SystemExit(f"--resume: {path} was run with other settings; use another --out")
        report["runs"] = earlier["runs"]
    done = {(r["pattern"], r["surface"]) for r in report["runs"]}
    retrieval = tutorials.build_retrieval()
    models = tutorials.Surfaces(
        args.draft, args.keep_rate, args.max_tokens, args.min_prompt_tokens, {"chunking": args.chunking}
    )
    try:
        for surface in args.surfaces:
            for pattern in args.patterns:
                if (pattern, surface) in done:
                    continue
                run = one_run(pattern, surface, models, retrieval, args)
                report["runs"].append(run)
                path.write_text(json.dumps(report, indent=1))
                out.with_suffix(".md").write_text(markdown(report))
                print(
                    f"{pattern:20} {surface:10} ran={run['ran']} tool={run['tool_calls']} calls={run['model_calls']} "
                    f"compressed={run['compressed']}/{run['calls_with_results']} ok={run['answer_ok']} "
                    f"{run['wall_s']} s: {run['answer'][:60]!r}",
                    flush=True,
                )
    finally:
        models.stop_gateway()


if __name__ == "__main__":
    main()
