"""Does the agent call its tool? The start of the agentic study's step 1, per system prompt (issue #45).

At step 1 of ``benchmarks/agentic.py`` (a HotpotQA question, the one ``search`` tool, ``tool_choice="auto"``) the
model either opens a tool call or starts an answer in prose, and its first token decides which: ``<tool_call>``,
or the chat template's doubled-brace ``{{"`` (the form Qwen2.5's template shows, which the lazy grammar takes as
a call), or a bare ``{"``. This script prefills step 1's prompt under each candidate system prompt, rendered as
the engine renders it (``prompt.chat.chat_layout``), continues it greedily for a few tokens, and records per
question the probability of those openings' first tokens and whether the greedy start holds a trigger of the lazy
grammar (``TRIGGERS``: then the engine writes a call). It is a
proxy for the study's step-1 natural calls, cheap enough to try several prompts on every question: ``--against``
compares it question by question with a stored agentic run of the same questions.

    python benchmarks/first_call.py --questions 100 --out benchmarks/results/agentic/first-call-prompts \
        --against benchmarks/results/agentic/hotpotqa-auto-template-opening.json

Writes ``<out>.json`` and ``<out>.md`` after every prompt (a rerun starts again: each prompt takes three to four
minutes for 100 questions on two cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agentic  # noqa: E402
import torch  # noqa: E402

from specprefill_rag.config import OutputFormat  # noqa: E402
from specprefill_rag.decode.formats import lazy_tool_call_tag  # noqa: E402
from specprefill_rag.models.loading import load_model  # noqa: E402
from specprefill_rag.prompt.chat import chat_layout  # noqa: E402

QWEN_DEFAULT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."  # Qwen2.5's own system prompt
OPENINGS = ("<tool_call>", '{{"', '{"')  # how a call's first token starts (hermes family)
# What the engine's lazy grammar takes as the start of a call of ``search`` (the family's marker, the template's
# opening, the bare JSON naming the tool), and enough greedy tokens to write any of them, even a marker in ordinary
# tokens.
LAZY = OutputFormat("tool_call", tools=(agentic.SEARCH,), tool_format="hermes", lazy=True)
TRIGGERS = tuple(lazy_tool_call_tag(LAZY)["format"]["triggers"])
GREEDY_TOKENS = 10
PROMPTS = {
    "agentic": agentic.SYSTEM,
    "qwen-default-then-agentic": f"{QWEN_DEFAULT} {agentic.SYSTEM}",
    "first-reply-is-a-call": (
        "Your first reply to every question is a call of the search tool, with a short query for the first fact "
        "you need; never answer from memory. Once the results hold the answer, reply with the answer alone: a "
        "short phrase."
    ),
    "no-knowledge-of-your-own": (
        "You have no knowledge of your own: every fact must come from the search tool. Call the search tool "
        "before answering, with a short query for each fact you need. Once the results hold the answer, reply "
        "with the answer alone: a short phrase."
    ),
    "agentic-with-an-example-call": (
        f"{agentic.SYSTEM} For example, to the question 'In which city is the Eiffel Tower?' your first reply is:\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "Eiffel Tower"}}\n</tool_call>'
    ),
    # The call above, then what follows the result: the example call alone taught the main to answer in the
    # template's result markup (docs/benchmarks/agentic.md).
    "agentic-with-an-example-exchange": (
        f"{agentic.SYSTEM} For example, to the question 'In which city is the Eiffel Tower?' your first reply is:\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "Eiffel Tower"}}\n</tool_call>\n'
        "and once the search results say that the Eiffel Tower stands in Paris, your reply is the answer alone:\n"
        "Paris"
    ),
    "agentic-with-an-example-question": (
        f"{agentic.SYSTEM} For example, to the question 'In which city is the Eiffel Tower?' your first reply is "
        "a search for 'Eiffel Tower'; once its results say 'Paris', your reply is 'Paris'."
    ),
    "tutorial-helpful-assistant": (
        "You are a helpful assistant. Use the search tool to look up facts before answering. Once the results "
        "hold the answer, reply with the answer alone: a short phrase."
    ),
}


def opening_ids(tokenizer: Any) -> list[int]:
    """The first token of each call opening in :data:`OPENINGS`, as the tokenizer writes it."""
    return sorted({tokenizer.encode(text, add_special_tokens=False)[0] for text in OPENINGS})


def starts_a_call(text: str) -> bool:
    """Whether ``text`` holds a trigger of the lazy grammar (then the engine would write a call of ``search``)."""
    return any(trigger in text for trigger in TRIGGERS)


@torch.inference_mode()
def step_start(model: Any, tokenizer: Any, system: str, question: str, openings: list[int]) -> dict:
    """Step 1's prompt prefilled once and continued greedily for :data:`GREEDY_TOKENS` tokens: the probability of
    the call openings' first tokens, and whether the greedy start opens a call (a marker may also be spelled in
    ordinary tokens, ``<`` ``tool`` ``_call`` ``>``, when the system prompt shows one as text: the lazy grammar
    matches triggers as text, so that is a call too)."""
    messages = agentic.opening(system, question)
    ids = chat_layout(tokenizer, messages, tools=[agentic.SEARCH], tool_choice="auto").layout.input_ids[None]
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=GREEDY_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.eos_token_id,
    )
    probabilities = out.scores[0][0].float().softmax(-1)
    start = tokenizer.decode(out.sequences[0, ids.shape[1] :]).lstrip()
    return {
        "prompt_tokens": ids.shape[1],
        "p_call": float(probabilities[openings].sum()),
        "greedy_start": start,
        "opens_call": starts_a_call(start),
    }


def agreement(report: dict, stored: dict) -> dict[str, int]:
    """Per prompt, on the questions both hold, how often ``opens_call`` equals the stored run's step-1 call."""
    system = stored["settings"]["system"]
    called = {r["question"]: r["runs"][next(iter(r["runs"]))]["natural_call"] for r in stored["records"]}
    return {
        name: sum(row["opens_call"] == called[row["question"]] for row in entry["records"] if row["question"] in called)
        for name, entry in report["prompts"].items()
        if entry["text"] == system
    }


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        f"Step 1 of the agentic study, its first {GREEDY_TOKENS} greedy tokens: {settings['questions']} HotpotQA "
        f"questions (seed {settings['seed']}), main {settings['main']}, {report['meta']['torch_dtype']}; the `search` "
        f"tool offered, tool_choice 'auto'. Machine: {report['meta']['machine']}. {report['meta']['date']}.",
        "",
        "| system prompt | questions | greedy start opens a call | P(first token opens a call), mean | median |",
        "|---|---|---|---|---|",
    ]
    for name, entry in report["prompts"].items():
        p = [row["p_call"] for row in entry["records"]]
        opens = sum(row["opens_call"] for row in entry["records"])
        share = f"{opens} ({opens / len(p):.0%})"
        lines.append(f"| {name} | {len(p)} | {share} | {statistics.mean(p):.2f} | {statistics.median(p):.2f} |")
    for name, agree in report.get("agreement", {}).items():
        against = f"Against `{settings['against']}` (greedy step 1, `{name}`)"
        lines += ["", f"{against}: the proxy agrees on {agree} questions."]
    lines += ["", "Prompts:", ""] + [f"- `{name}`: {entry['text']}" for name, entry in report["prompts"].items()]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--main", default=agentic.MAIN)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--prompts", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    parser.add_argument("--against", help="a stored agentic run (.json) of the same questions to compare with")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, model: Any = None, tokenizer: Any = None) -> dict:
    args = parse(argv)
    if model is None:
        loaded = load_model(args.main, dtype=args.dtype)
        model, tokenizer = loaded.model, loaded.tokenizer
    openings = opening_ids(tokenizer)
    samples = agentic.load_questions(args.questions, args.seed)
    meta = {"machine": agentic.machine(), "torch_dtype": str(model.dtype).removeprefix("torch."), "date": agentic.now()}
    report: dict = {"settings": vars(args), "meta": {**meta, "versions": agentic.versions()}, "prompts": {}}
    stored = json.loads(Path(args.against).read_text()) if args.against else None
    for name in args.prompts:
        began = time.perf_counter()
        rows = [
            {"question": i, **step_start(model, tokenizer, PROMPTS[name], sample["question"], openings)}
            for i, sample in enumerate(samples)
        ]
        report["prompts"][name] = {"text": PROMPTS[name], "records": rows, "seconds": time.perf_counter() - began}
        if stored is not None:
            report["agreement"] = agreement(report, stored)
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1))
        Path(f"{args.out}.md").write_text(markdown(report))
        print(f"{name}: {sum(r['opens_call'] for r in rows)} of {len(rows)} open a call", flush=True)
    return report


if __name__ == "__main__":
    main()
