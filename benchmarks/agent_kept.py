"""What the draft keeps of an agent's tool result, and what the main model answers from it (issue #45).

Rebuilds the prompt of agent_patterns.py's LangChain ``bind_tools`` step after its one search (the system
prompt, the question, the call, the tool's ``--k`` best chunks as its result, the retriever tool offered) with
the engine's own messages, then prints, per keep rate, how many tokens are kept, whether the kept document text
holds the expected answer, the kept text itself, and the answer the main model writes from it. It tells a draft
that drops the answer from a main model that does not use it.

    python benchmarks/agent_kept.py --k 8 --keep-rates 0.3 0.5 1
    python benchmarks/agent_kept.py --draft self
    python benchmarks/agent_kept.py --chunking sentences
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import tutorials  # noqa: E402
from agent_patterns import EXPECTED, QUESTION, SYSTEM, Tool  # noqa: E402
from langchain_core.utils.function_calling import convert_to_openai_tool  # noqa: E402

from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.prompt.chat import ChatMessage  # noqa: E402
from specprefill_rag.results import ToolCall  # noqa: E402


def offered(tool: Tool) -> list[dict[str, Any]]:
    """The retriever tool as LangChain's ``bind_tools`` sends it."""
    return [convert_to_openai_tool(tool.langchain())]


def messages(result: str) -> list[ChatMessage]:
    call = ToolCall("retrieve_context", {"query": QUESTION}, "call_1")
    return [
        ChatMessage("system", [SYSTEM]),
        ChatMessage("user", [QUESTION]),
        ChatMessage("assistant", [], (call,)),
        ChatMessage("tool", [result], tool_call_id="call_1"),
    ]


def kept_document_text(
    engine: SpecPrefillEngine, chat: list[ChatMessage], tools: list[dict[str, Any]], keep_rate: float
) -> tuple[int, int, str]:
    """(kept tokens, prompt tokens, the kept document tokens' text) of the draft's selection."""
    layout = engine.chat_layout(chat, tools=tools).layout
    kept = engine.select(layout, keep_rate=keep_rate).kept
    in_documents = kept[layout.document_index[kept] >= 0]
    return int(kept.numel()), len(layout), engine.tokenizer.decode(layout.input_ids[in_documents])


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--main", default=tutorials.MAIN)
    options.add_argument("--draft", default=tutorials.DRAFTS[0])
    options.add_argument("--k", type=int, default=8, help="chunks the tool returns")
    options.add_argument("--keep-rates", type=float, nargs="+", default=[0.3])
    options.add_argument("--max-tokens", type=int, default=160)
    options.add_argument("--chunking", default="tokens", choices=["tokens", "sentences"])
    args = options.parse_args()
    tool = Tool(tutorials.build_retrieval(), args.k)
    tools, chat = offered(tool), messages(tool.retrieve(QUESTION))
    engine = SpecPrefillEngine(main=args.main, draft=args.draft, min_prompt_tokens=0, chunking=args.chunking)
    for keep_rate in args.keep_rates:
        kept, total, text = kept_document_text(engine, chat, tools, keep_rate)
        answer = engine.chat(chat, tools=tools, keep_rate=keep_rate, max_new_tokens=args.max_tokens).text
        print(f"## keep {keep_rate:g}: {kept} of {total} tokens kept; {EXPECTED!r} in the kept documents: "
              f"{EXPECTED in text}\n\n{text}\n\nAnswer: {answer}\n")  # fmt: skip


if __name__ == "__main__":
    main()
