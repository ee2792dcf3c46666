"""What the draft scores a tool result against (issue #45): the draft's query text after a tool result.

After a tool result the prompt ends with the tool's output and the assistant header, so the draft's own last
tokens and look-ahead would score the documents against a generic opening ("To answer ..."). The engine
therefore appends a query the main model never prefills (``PromptLayout.draft_query_ids``): before this study
the question and the pending call's arguments, now the arguments, the question and ``Answer:``. Which tokens
the draft's look-ahead then generates decides what is kept. This study compares query forms on the same prompts:

* ``question-args``: ``Question: <q>`` then the call's arguments as JSON (the engine's form before this study);
* ``question-answer``: ``Question: <q>`` then ``Answer:`` (the look-ahead starts the answer);
* ``args-question-answer``: the arguments, ``Question: <q>``, ``Answer:`` (the engine's form now);
* ``args-question-answer-is`` and ``args-question-short-answer`` (``--forms``): the same ending ``Answer: The
  answer is`` or ``Short answer:``; the paired change is against the first form given.

Each HotpotQA question (``agentic.load_questions``, read in place from ../shared/data) gets one search, its
query the question (BM25 top ``--top-k`` of its paragraphs, as ``benchmarks/agentic.py``'s tool), as an agent's
second step sees it: system prompt, question, the assistant's call, the tool result. Per form and keep rate the
record keeps whether a gold answer is in the kept part of the tool result ("answer kept", counted where it is
in the whole result and is not yes or no; only the draft runs, a few seconds a question); with ``--answers`` the
main model also answers (greedy, its first line, ``--answer-tokens``; keep 1 once) and the record keeps whether
a gold answer is in it ("correct"). Paired differences against ``question-args`` come with 95% bootstrap
intervals.

    python benchmarks/tool_query.py --questions 100 --out benchmarks/results/tool-query/hotpotqa-0.5b
    python benchmarks/tool_query.py --questions 100 --draft self --out benchmarks/results/tool-query/hotpotqa-self
    python benchmarks/tool_query.py --report --out benchmarks/results/tool-query/hotpotqa-0.5b

``--task squad`` or ``--task nq`` holds the forms out on other questions: a SQuAD v1.1 or NQ-open question
with its gold passage among 9 others (``tasks.squad`` / ``tasks.nq``, 10 passages), searched the same way.

    python benchmarks/tool_query.py --task squad --questions 100 --forms args-question-answer \
        args-question-short-answer --out benchmarks/results/tool-query/squad-0.5b-endings

Writes ``<out>.json`` and ``<out>.md`` after every question. No timings: the forms cost the same (a few query
tokens more or less).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agentic  # noqa: E402
import tasks  # noqa: E402
import torch  # noqa: E402
from quality import bootstrap_interval, bootstrap_ratio_interval, normalise, scores  # noqa: E402

from specprefill_rag import GenerationParams, SpecPrefillEngine  # noqa: E402
from specprefill_rag.config import is_self_spec  # noqa: E402
from specprefill_rag.prompt.chat import ChatMessage  # noqa: E402
from specprefill_rag.prompt.layout import PromptLayout  # noqa: E402
from specprefill_rag.prompt.tokens import encode_as_text  # noqa: E402
from specprefill_rag.results import ToolCall  # noqa: E402

FORMS = ["question-args", "question-answer", "args-question-answer"]
MORE_FORMS = ["args-question-answer-is", "args-question-short-answer"]  # variants tried after the engine's change
KEEP_RATES = [0.3, 0.1]
TASKS = ["hotpotqa", "squad", "nq"]
PASSAGES = 10  # per SQuAD / NQ question, as HotpotQA's distractor setting


def query_text(form: str, question: str, arguments: dict) -> str:
    """The draft's query after a tool result, in ``form``."""
    args = json.dumps(arguments, ensure_ascii=False)
    texts = {
        "question-args": f"\n\nQuestion: {question}\n{args}",
        "question-answer": f"\n\nQuestion: {question}\nAnswer:",
        "args-question-answer": f"\n\n{args}\nQuestion: {question}\nAnswer:",
        "args-question-answer-is": f"\n\n{args}\nQuestion: {question}\nAnswer: The answer is",
        "args-question-short-answer": f"\n\n{args}\nQuestion: {question}\nShort answer:",
    }
    return texts[form]


def with_query(layout: PromptLayout, tokenizer: Any, text: str) -> PromptLayout:
    """``layout`` whose draft reads ``text`` after the prompt (on another tokenizer's path too: its source)."""
    ids = encode_as_text(tokenizer, text)[0]
    source = replace(layout.source, draft_query=text) if layout.source is not None else None
    return replace(layout, draft_query_ids=layout.input_ids.new_tensor(ids), source=source)


def titled(sample: dict) -> dict:
    """A ``tasks.squad`` / ``tasks.nq`` sample with its passages as ``(title, text)`` for ``agentic.search``."""
    parts = [document.partition(": ") for document in sample["documents"]]
    untitled = not all(sep for _, sep, _ in parts)  # SQuAD's contexts carry no title: number them
    paragraphs = [
        (f"Passage {index + 1}", document) if untitled else (title, text)
        for index, (document, (title, _, text)) in enumerate(zip(sample["documents"], parts))
    ]
    return {**sample, "paragraphs": paragraphs}


def load_samples(task: str, count: int, seed: int) -> list[dict]:
    """The questions of ``task``, each with the paragraphs its one search ranks."""
    if task == "hotpotqa":
        return agentic.load_questions(count, seed)
    tasks.require_data()
    loader = {"squad": tasks.squad, "nq": tasks.nq}[task]
    return [titled(sample) for sample in loader(count, PASSAGES, seed)]


def second_step(sample: dict, system: str, top_k: int) -> tuple[list[ChatMessage], dict]:
    """An agent's second step: the question searched as asked, its result appended."""
    arguments = {"query": sample["question"]}
    text, chosen = agentic.search(sample, sample["question"], top_k)
    messages = [
        ChatMessage("system", [system]),
        ChatMessage("user", [sample["question"]]),
        ChatMessage("assistant", [], (ToolCall("search", arguments, "call_1"),)),
        ChatMessage("tool", [text], tool_call_id="call_1"),
    ]
    return messages, {"arguments": arguments, "returned": chosen, "result": text}


def kept_documents(layout: PromptLayout, kept: torch.Tensor | None) -> torch.Tensor:
    """``[K_d]`` the indices of ``layout``'s document tokens among ``kept`` (``[K]``; None: all of them)."""
    document = (layout.document_index >= 0).nonzero().flatten()
    return document if kept is None else document[torch.isin(document, kept)]


def kept_document_text(layout: PromptLayout, kept: torch.Tensor | None, tokenizer: Any) -> str:
    """The document tokens of ``layout`` at the kept indices, decoded in order."""
    return tokenizer.decode(layout.input_ids[kept_documents(layout, kept)].tolist())


def contains_answer(text: str, answers: list[str]) -> bool:
    return any(normalise(answer) in normalise(text) for answer in answers)


def checkable(answers: list[str]) -> bool:
    """Whether "answer kept" means anything: not for yes/no questions (their answer is not in the text)."""
    return not {normalise(answer) for answer in answers} & {"yes", "no"}


def selected(engine: SpecPrefillEngine, layout: PromptLayout, keep_rate: float, answers: list[str]) -> dict:
    """What the draft keeps of the tool result at ``keep_rate``: whether a gold answer survives, and how much."""
    chosen = kept_documents(layout, engine.select(layout, keep_rate=keep_rate).kept)
    kept = engine.tokenizer.decode(layout.input_ids[chosen].tolist())
    return {
        "answer_kept": contains_answer(kept, answers),
        "kept_document_tokens": chosen.numel(),
        "document_tokens": kept_documents(layout, None).numel(),
    }


def answered(engine: SpecPrefillEngine, layout: PromptLayout, keep_rate: float, answers: list[str], tokens: int):
    """The main model's answer at ``keep_rate`` (its first line) and whether it holds a gold answer."""
    result = engine.generate_layout(layout, GenerationParams(max_new_tokens=tokens, stop=["\n"]), keep_rate=keep_rate)
    text = result.text.strip()
    return {"answer": text, "correct": scores(text, answers)["contains"]}


def one_question(engine: SpecPrefillEngine, sample: dict, args: argparse.Namespace) -> dict:
    messages, search = second_step(sample, args.system, args.top_k)
    layout = engine.chat_layout(messages, tools=[agentic.SEARCH]).layout
    answers = sample["answers"]
    runs = {"1": answered(engine, layout, 1.0, answers, args.answer_tokens)} if args.answers else {}
    for form in args.forms:
        formed = with_query(layout, engine.tokenizer, query_text(form, sample["question"], search["arguments"]))
        for rate in args.keep_rates:
            run = selected(engine, formed, rate, answers)
            if args.answers:
                run.update(answered(engine, formed, rate, answers, args.answer_tokens))
            runs[f"{form}@{rate:g}"] = run
    return {
        "text": sample["question"],
        "answers": sample["answers"],
        "returned": search["returned"],
        "answer_in_result": checkable(sample["answers"]) and contains_answer(search["result"], sample["answers"]),
        "runs": runs,
    }


def summary(report: dict) -> list[dict]:
    """Per form and keep rate: answers, retention against keep 1, the paired change against the first form."""
    records = report["records"]
    settings = report["settings"]
    base_form = settings["forms"][0]
    with_answers = settings["answers"]
    rows = []
    for form in settings["forms"]:
        for rate in settings["keep_rates"]:
            key, base = f"{form}@{rate:g}", f"{base_form}@{rate:g}"
            values = [r["runs"][key]["correct"] for r in records] if with_answers else []
            full = [r["runs"]["1"]["correct"] for r in records] if with_answers else []
            kept = [float(r["runs"][key]["answer_kept"]) for r in records if r["answer_in_result"]]
            base_kept = [float(r["runs"][base]["answer_kept"]) for r in records if r["answer_in_result"]]
            against = [r["runs"][key]["correct"] - r["runs"][base]["correct"] for r in records] if with_answers else []
            rows.append(
                {
                    "form": form,
                    "keep_rate": rate,
                    "n": len(records),
                    "correct": sum(values),
                    "retention": sum(values) / sum(full) if sum(full) else float("nan"),
                    "retention_ci": bootstrap_ratio_interval(values, full),
                    "change": sum(against) / len(against) if against else float("nan"),
                    "change_ci": bootstrap_interval(against),
                    "answer_kept": sum(kept),
                    "answer_in_result": len(kept),
                    "kept_change": (sum(kept) - sum(base_kept)) / len(kept) if kept else float("nan"),
                    "kept_change_ci": bootstrap_interval([a - b for a, b in zip(kept, base_kept)]),
                }
            )
    return rows


TASK_NAMES = {"hotpotqa": "HotpotQA", "squad": "SQuAD v1.1", "nq": "NQ-open"}


def markdown(report: dict) -> str:
    meta, settings, records = report["meta"], report["settings"], report["records"]
    with_answers = settings["answers"]
    task = TASK_NAMES[settings.get("task", "hotpotqa")]
    full = f"; keep 1 answers {sum(r['runs']['1']['correct'] for r in records):g} correctly" if with_answers else ""
    lines = [
        f"Main {settings['main']}, draft {settings['draft']}; {len(records)} {task} questions, one search each "
        f"(top {settings['top_k']}); the gold answer is in the tool result for "
        f"{sum(r['answer_in_result'] for r in records)}{full}. Machine: {meta['machine']}; {meta['date']}.",
        "",
        f"| draft query | keep | n | answer kept (of those in the result) | change in answer kept vs "
        f"{settings['forms'][0]} (95% CI) |"
        + (" correct | retention (95% CI) | change (95% CI) |" if with_answers else ""),
        "|---|---|---|---|---|" + ("---|---|---|" if with_answers else ""),
    ]
    for row in summary(report):
        line = (
            f"| {row['form']} | {row['keep_rate']:g} | {row['n']} "
            f"| {row['answer_kept']:g} of {row['answer_in_result']} "
            f"| {row['kept_change']:+.3f} ({row['kept_change_ci'][0]:+.2f} to {row['kept_change_ci'][1]:+.2f}) |"
        )
        if with_answers:
            line += (
                f" {row['correct']:g} | {row['retention']:.0%} ({row['retention_ci'][0]:.0%} to "
                f"{row['retention_ci'][1]:.0%}) | {row['change']:+.3f} ({row['change_ci'][0]:+.2f} to "
                f"{row['change_ci'][1]:+.2f}) |"
            )
        lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--questions", type=int, default=60)
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--task", default="hotpotqa", choices=TASKS, help="whose questions and passages")
    options.add_argument("--main", default=agentic.MAIN)
    options.add_argument("--draft", default=agentic.DRAFT)
    options.add_argument("--forms", nargs="+", default=FORMS, choices=FORMS + MORE_FORMS)
    options.add_argument("--keep-rates", type=float, nargs="+", default=KEEP_RATES)
    options.add_argument("--top-k", type=int, default=3, help="paragraphs the search returns")
    options.add_argument("--answers", action="store_true", help="the main model answers too (slower)")
    options.add_argument("--answer-tokens", type=int, default=32)
    options.add_argument("--system", default=agentic.SYSTEM)
    options.add_argument("--out", type=Path, default=agentic.ROOT / "benchmarks" / "results" / "tool-query" / "run")
    options.add_argument(
        "--draft-queries",
        default="look_ahead",
        choices=["look_ahead", "window"],
        help="what a separate draft scores with (the recorded runs: the look-ahead, the library's default)",
    )
    options.add_argument("--resume", action="store_true", help="keep the questions an earlier run saved at --out")
    options.add_argument("--report", action="store_true", help="rewrite <out>.md from <out>.json; run nothing")
    args = options.parse_args()
    path, md = Path(f"{args.out}.json"), Path(f"{args.out}.md")  # not with_suffix: "hotpotqa-0.5b" has a dot
    if args.report:
        md.write_text(markdown(json.loads(path.read_text())))
        return
    names = ("main", "draft", "forms", "keep_rates", "top_k", "answers", "answer_tokens", "seed")
    settings = {name: getattr(args, name) for name in names}
    if args.task != "hotpotqa":  # the earlier runs' settings have no task: they stay resumable
        settings["task"] = args.task
    if args.draft_queries != "look_ahead":  # likewise
        settings["draft_queries"] = args.draft_queries
    settings["system"] = args.system
    report: dict[str, Any] = {"settings": settings, "records": []}
    if args.resume and path.exists():
        earlier = json.loads(path.read_text())
        if earlier["settings"] != settings:
            raise SystemExit(f"--resume: {path} was run with other settings; use another --out")
        report["records"] = earlier["records"]
    report["meta"] = {
        "machine": agentic.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }
    queries = {} if is_self_spec(args.draft) else {"draft_queries": args.draft_queries}  # 'self': always the window
    engine = SpecPrefillEngine(main=args.main, draft=args.draft, min_prompt_tokens=0, **queries)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    samples = load_samples(args.task, args.questions, args.seed)
    for index, sample in enumerate(samples[len(report["records"]) :], start=len(report["records"])):
        record = {"question": index, **one_question(engine, sample, args)}
        report["records"].append(record)
        path.write_text(json.dumps(report, indent=1))
        md.write_text(markdown(report))
        cells = " ".join(f"{k}:{'kept' if v.get('answer_kept') else '-'}" for k, v in record["runs"].items())
        print(f"question {index}: {cells}", flush=True)


if __name__ == "__main__":
    main()
