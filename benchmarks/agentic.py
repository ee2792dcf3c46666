"""Agentic multi-hop study: a tool-calling agent over HotpotQA, its tool results compressed (issue #30).

Each HotpotQA distractor question (benchmarks/tasks.py ``hotpotqa``, read in place from ../shared/data)
gets an agent with ONE tool, ``search(query)``: it returns the top ``--top-k`` of that question's 10
paragraphs ranked by BM25 (written here, deterministic: ties go to the earlier paragraph), as
``Title: ...`` blocks. The agent loop, at most ``--max-steps`` model turns:

* step 1 asks with the tool offered (``tool_choice="auto"``, the frameworks' default: the engine's lazy
  grammar constrains a call once the answer starts one); whether the model called it is recorded. When it did
  not, its text is the answer (the study of issue #45). With ``--force-search`` (the study of issue #30) the
  answer it gave without searching is scored (``closed_book_correct``) and one search is then forced
  (``tool_choice="required"``, constrained decoding), so every question reaches a tool result: natural calls
  and forced calls are counted apart;
* every call is executed, the assistant message with its calls and the tool results are appended, and
  the model is asked again (``auto``) until it answers without a call;
* the last step uses ``tool_choice="none"``: it must answer (its first line).

Step 1 has no tool result, so its prompt is prefilled whole at every keep rate and greedy decoding gives the
same turn: it is generated once per question and shared (``--no-share-first-step`` generates it at every rate).

Tool results are the documents SpecPrefill compresses (after a tool result the draft scores them against
the question and the call's arguments). Keep rates 1.0 (full prefill), 0.3 and 0.1 run on the same
questions with one engine, back to back per question (their order rotates from question to question), so
machine noise hits all alike; the main model decodes greedily.

Per question and keep rate: the final answer's correctness (normalised containment of the gold answer,
benchmarks/quality.py's ``scores``), tool-call parse failures (``invalid_tool_calls``), steps used, and per
model turn its TTFT, prompt tokens, kept share and whether it was compressed (``uncompressed_reason``
otherwise). The report: answer retention against keep 1.0 with the paired difference (bootstrap 95%
intervals), parse failures per keep rate, mean steps, TTFT median and IQR per step, TTFT speed-up against
keep 1.0 per step (ratio of medians over the questions both ran that step), and the raw text of failures.

    python benchmarks/agentic.py --questions 30 --out benchmarks/results/agentic/hotpotqa
    python benchmarks/agentic.py --questions 30 --out benchmarks/results/agentic/hotpotqa --resume
    python benchmarks/agentic.py --report --out benchmarks/results/agentic/hotpotqa   # the .md from the .json

Writes ``<out>.json`` (every record) and ``<out>.md`` (the tables) after every question; ``--resume`` keeps
the questions an earlier run saved (``--questions`` may grow). ``--min-prompt-tokens`` is 0 by default so the
keep rates are measured at every length; ``auto`` (the engine's default: the length from which the draft
pays, 1,024 tokens for this pair) leaves shorter prompts whole, which the records show as ``short_prompt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tasks  # noqa: E402
import torch  # noqa: E402
from quality import bootstrap_interval, bootstrap_ratio_interval, sample_digest, scores  # noqa: E402

from specprefill_rag.decode.tool_calls import parse_tool_calls  # noqa: E402
from specprefill_rag.prompt.chat import ChatMessage  # noqa: E402
from specprefill_rag.prompt.tools import tool_call_format  # noqa: E402
from specprefill_rag.results import GenerationResult, ToolCall  # noqa: E402

ROOT = tasks.ROOT
MAIN = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
KEEP_RATES = [1.0, 0.3, 0.1]
SYSTEM = (
    "Before answering any question you must call the search tool; never answer without searching first. Search an "
    "encyclopedia with a short query for each fact you need. Once the results hold the answer, reply with the "
    "answer alone: a short phrase."
)
# The system prompt of issue #30's study (docs/benchmarks/agentic.md, the forced-search run): asked to search, the
# pair answered from memory in 30 of 30 questions; --system takes it back.
SYSTEM_30 = (
    "You answer questions with the help of a search tool over an encyclopedia. Call search with a short query "
    "for each fact you need. Once the results hold the answer, reply with the answer alone: a short phrase, "
    "no explanation and no plan."
)
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the encyclopedia. Returns the best matching paragraphs, each with its title.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up"}},
            "required": ["query"],
        },
    },
}
# The settings that shape the records: a resumed run must agree on all of them.
STUDY = [
    "main",
    "draft",
    "dtype",
    "seed",
    "top_k",
    "max_steps",
    "keep_rates",
    "max_new_tokens",
    "answer_tokens",
    "min_prompt_tokens",
    "draft_cache_mb",
    "system",
    "sampler",
    "share_first_step",
    "force_search",
    "lazy_tool_grammar",
    "chunking",
]
STAT_FIELDS = (
    "ttft_ms",
    "draft_ms",
    "main_prefill_ms",
    "prompt_tokens",
    "document_tokens",
    "kept_tokens",
    "kept_document_tokens",
    "keep_rate",
    "compressed",
    "uncompressed_reason",
    "completion_tokens",
    "draft_path",
    "draft_cached_tokens",
)


# -- the tool -------------------------------------------------------------------------------------------

WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def bm25_rank(query: str, paragraphs: Sequence[str], k1: float = 1.5, b: float = 0.75) -> list[int]:
    """The paragraphs' indices, best BM25 score first (Okapi BM25, idf ``log(1 + (N - df + 0.5) / (df + 0.5))``,
    statistics over these paragraphs alone); ties keep the paragraphs' order."""
    documents = [words(p) for p in paragraphs]
    average = sum(map(len, documents)) / max(1, len(documents)) or 1.0
    frequency = Counter(w for d in documents for w in set(d))
    terms = words(query)

    def score(document: list[str]) -> float:
        counts = Counter(document)
        total = 0.0
        for term in terms:
            if counts[term]:
                idf = math.log(1 + (len(documents) - frequency[term] + 0.5) / (frequency[term] + 0.5))
                tf = counts[term]
                total += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(document) / average))
        return total

    scored = [score(d) for d in documents]
    return sorted(range(len(documents)), key=lambda i: (-scored[i], i))


def query_of(arguments: Any) -> str:
    """The call's query: its ``query`` argument, else every string argument (a model may name it otherwise)."""
    if isinstance(arguments, dict):
        if isinstance(arguments.get("query"), str):
            return arguments["query"]
        return " ".join(str(v) for v in arguments.values())
    return str(arguments)


def search(sample: dict, query: str, top_k: int) -> tuple[str, list[int]]:
    """The tool: the top ``top_k`` of the sample's paragraphs for ``query``, as ``Title: ...`` blocks."""
    paragraphs = [f"{title} {text}" for title, text in sample["paragraphs"]]
    chosen = bm25_rank(query, paragraphs)[:top_k]
    blocks = [f"Title: {sample['paragraphs'][i][0]}\n{sample['paragraphs'][i][1]}" for i in chosen]
    return "\n\n".join(blocks), chosen


def load_questions(count: int, seed: int) -> list[dict]:
    """``tasks.hotpotqa`` samples with each paragraph's title and text apart (from the same file, in place)."""
    tasks.require_data()
    samples = tasks.hotpotqa(count, seed)
    rows = json.loads((tasks.DATA / "hotpotqa" / "hotpotqa_train_distractor_100.json").read_text())
    by_question = {row["question"]: row for row in rows}
    for sample in samples:
        titles = [title for title, _ in by_question[sample["question"]]["context"]]
        assert len(titles) == len(sample["documents"])
        sample["paragraphs"] = [(t, d[len(t) + 2 :]) for t, d in zip(titles, sample["documents"])]
    return samples


# -- the agent ------------------------------------------------------------------------------------------


def generation_record(engine: Any, step: int, choice: str, result: GenerationResult, wall_ms: float) -> dict:
    stats = result.stats.as_dict()
    record = {"step": step, "tool_choice": choice, **{name: stats.get(name) for name in STAT_FIELDS}}
    record["kept_share"] = stats["kept_tokens"] / stats["prompt_tokens"] if stats["prompt_tokens"] else 1.0
    record.update(
        {
            "finish_reason": result.finish_reason,
            "tool_calls": [{"name": c.name, "arguments": dict(c.arguments)} for c in result.tool_calls],
            "invalid_tool_calls": [
                {"name": c.name, "arguments": c.arguments, "error": c.error} for c in result.invalid_tool_calls
            ],
            "text": result.text,
            "raw": engine.tokenizer.decode(result.token_ids, skip_special_tokens=False),
            "wall_ms": wall_ms,
        }
    )
    return record


CALL_AS_TEXT = re.compile(r'"name"\s*:\s*"search"|"query"\s*:')


def call_as_text(turn: dict) -> bool:
    """A turn that wrote a search call outside the tool-call markup (a JSON code block, say): not parsed,
    so neither a call nor an invalid call; the loop takes it as the answer."""
    return not turn["tool_calls"] and not turn["invalid_tool_calls"] and bool(CALL_AS_TEXT.search(turn["text"]))


def reparsed(report: dict) -> dict:
    """``report`` with every generated turn's raw text parsed again by today's tool-call parser (the decode is
    the same; only what counts as a call, an invalid call or content may change). A turn whose valid calls
    change would have led the loop elsewhere: that is an error, not a report. A run whose answer came from a
    turn takes that turn's new content.
    """
    call_format = report.get("meta", {}).get("tool_format", "hermes")  # runs before it was recorded: the Qwen pair
    for record in report["records"]:
        for run in record["runs"].values():
            for turn in run["turns"]:
                if turn["tool_choice"] == "none":
                    continue
                parsed = parse_tool_calls(turn["raw"], call_format, offered=(SEARCH["function"]["name"],))
                if [c.name for c in parsed.tool_calls] != [c["name"] for c in turn["tool_calls"]]:
                    raise ValueError(f"question {record['question']}: the calls of step {turn['step']} changed")
                turn["text"] = parsed.content
                turn["invalid_tool_calls"] = [
                    {"name": c.name, "arguments": c.arguments, "error": c.error} for c in parsed.invalid_tool_calls
                ]
            last = run["turns"][-1]
            if not last["tool_calls"] and last["tool_choice"] != "none":
                run["answer"] = last["text"].strip()
                run["correct"] = scores(run["answer"], record["answers"])["contains"]
            run["parse_failures"] = sum(len(t["invalid_tool_calls"]) for t in run["turns"])
    return report


def strict_correct(run: dict) -> float:
    """``correct``, but 0 for a final answer that is a search call written as text: the gold answer inside its
    query is no answer."""
    return 0.0 if CALL_AS_TEXT.search(run["answer"]) else run["correct"]


def opening(system: str, question: str) -> list[ChatMessage]:
    """Step 1's messages: the system prompt and the question (``first_call.py`` renders the same)."""
    return [ChatMessage("system", [system]), ChatMessage("user", [question])]


def run_agent(engine: Any, sample: dict, keep_rate: float, args: argparse.Namespace, first: dict | None = None) -> dict:
    """One question at one keep rate: the loop of model turns, tool calls and tool results.

    ``first``: step 1's turns of this question at another keep rate, by tool_choice, ``(result, record)``.
    Step 1 has no tool result, so its prompt is prefilled whole at every keep rate and greedy decoding gives
    the same turn: with ``--share-first-step`` it is generated once per question (the records say
    ``shared``) and filled in here, else into ``first`` for the next keep rate.
    """
    messages = opening(args.system, sample["question"])
    generations: list[dict] = []
    searches: list[dict] = []
    run: dict[str, Any] = {"natural_call": None, "forced": False, "forced_failed": False, "closed_book_correct": None}
    answer = ""
    started = time.perf_counter()

    def ask(step: int, choice: str) -> GenerationResult:
        if step == 1 and first is not None and choice in first:
            result, record = first[choice]
            generations.append({**record, "shared": True})
            return result
        limit = args.answer_tokens if choice == "none" else args.max_new_tokens
        began = time.perf_counter()
        result = engine.chat(
            messages,
            tools=[SEARCH],
            tool_choice=choice,
            parallel_tool_calls=choice != "required",  # the forced search is one call
            keep_rate=keep_rate,
            max_new_tokens=limit,
            stop=["\n"] if choice == "none" else [],  # the answer: its first line (nothing is parsed)
        )
        generations.append(generation_record(engine, step, choice, result, (time.perf_counter() - began) * 1000))
        if step == 1 and first is not None:
            first[choice] = (result, generations[-1])
        return result

    for step in range(1, args.max_steps + 1):
        choice = "none" if step == args.max_steps else "auto"
        result = ask(step, choice)
        calls = result.tool_calls if choice != "none" else ()
        if step == 1:
            run["natural_call"] = bool(calls)
            if not calls and args.force_search:  # answered without searching: score that, then force a search
                run["closed_book_correct"] = scores(result.text.strip(), sample["answers"])["contains"]
                run["forced"] = True
                calls = ask(step, "required").tool_calls
                run["forced_failed"] = not calls
                if not calls:
                    continue  # no tool result this step; the next step asks again
        if not calls:
            answer = result.text.strip()
            break
        named = tuple(ToolCall(c.name, dict(c.arguments), f"call_{step}_{i}") for i, c in enumerate(calls))
        said = generations[-1]["text"].strip()
        messages.append(ChatMessage("assistant", [said] if said else [], named))
        for call in named:
            query = query_of(call.arguments)
            text, chosen = search(sample, query, args.top_k)
            gold = [i for i in chosen if i in sample["gold_documents"]]
            searches.append({"step": step, "name": call.name, "query": query, "returned": chosen, "gold": gold})
            messages.append(ChatMessage("tool", [text], tool_call_id=call.id))
    correct = scores(answer, sample["answers"])["contains"]
    found = {i for s in searches for i in s["gold"]}
    search_steps = len({s["step"] for s in searches})
    return {
        **run,
        "answer": answer,
        "correct": correct,
        "steps": len({g["step"] for g in generations}),
        "generations": len(generations),
        "parse_failures": sum(len(g["invalid_tool_calls"]) for g in generations),
        "tool_markup_in_answer": "<tool_call>" in answer,
        "n_searches": len(searches),
        "search_steps": search_steps,
        "out_of_steps": any(g["tool_choice"] == "none" for g in generations),
        "gold_found": len(found),
        "gold_total": len(sample["gold_documents"]),
        "turns": generations,
        "searches": searches,
        "seconds": time.perf_counter() - started,
    }


def rate_key(rate: float) -> str:
    return f"{rate:g}"


def rotated(rates: list[float], index: int) -> list[float]:
    """The keep rates in the order question ``index`` runs them: rotated one place per question."""
    shift = index % len(rates)
    return rates[shift:] + rates[:shift]


def run(engine: Any, samples: list[dict], args: argparse.Namespace, report: dict, save: Callable[[dict], None]) -> dict:
    """Every question not in ``report`` yet, all keep rates back to back; ``save`` after each question."""
    done = {r["question"] for r in report["records"]}
    for index, sample in enumerate(samples):
        if index in done:
            continue
        load_before = os.getloadavg()
        order = rotated(list(args.keep_rates), index)
        first: dict | None = {} if args.share_first_step else None
        runs = {rate_key(rate): run_agent(engine, sample, rate, args, first) for rate in order}
        record = {
            "question": index,
            "digest": sample_digest({k: v for k, v in sample.items() if k != "paragraphs"}),
            "text": sample["question"],
            "answers": sample["answers"],
            "gold_documents": sample["gold_documents"],
            "order": [rate_key(r) for r in order],
            "load_before": list(load_before),
            "load_after": list(os.getloadavg()),
            "runs": runs,
        }
        report["records"].append(record)
        report["records"].sort(key=lambda r: r["question"])
        report["sessions"][-1].update(ended=now(), load_end=list(os.getloadavg()))
        save(report)
        cells = " ".join(
            f"{k}:{'ok' if v['correct'] else 'no'}/{v['steps']}st/{v['search_steps']}srch/"
            f"{'nat' if v['natural_call'] else 'forced' if v['forced'] else 'nocall'}"
            for k, v in runs.items()
        )
        print(f"question {index}: {cells} {sum(v['seconds'] for v in runs.values()):.0f} s", flush=True)
    return report


# -- the report -----------------------------------------------------------------------------------------


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summary_rows(report: dict) -> list[dict]:
    """One row per keep rate: answers, retention and the paired change against keep 1.0, failures, steps."""
    records = report["records"]
    rates = report["settings"]["keep_rates"]
    full = rate_key(1.0) if 1.0 in rates else rate_key(max(rates))
    rows = []
    for rate in rates:
        key = rate_key(rate)
        chosen = [r for r in records if key in r["runs"] and full in r["runs"]]
        values = [r["runs"][key]["correct"] for r in chosen]
        references = [r["runs"][full]["correct"] for r in chosen]
        strict = [strict_correct(r["runs"][key]) for r in chosen]
        strict_references = [strict_correct(r["runs"][full]) for r in chosen]
        runs = [r["runs"][key] for r in chosen]
        turns = [t for run in runs for t in run["turns"]]
        with_results = [t for t in turns if t["document_tokens"]]
        rows.append(
            {
                "keep_rate": rate,
                "n": len(chosen),
                "correct": sum(values),
                "accuracy": sum(values) / len(values) if values else float("nan"),
                "retention": sum(values) / sum(references) if sum(references) else float("nan"),
                "retention_ci": bootstrap_ratio_interval(values, references),
                "change": (sum(values) - sum(references)) / len(values) if values else float("nan"),
                "change_ci": bootstrap_interval([v - f for v, f in zip(values, references)]),
                "strict_correct": sum(strict),
                "strict_change": (sum(strict) - sum(strict_references)) / len(strict) if strict else float("nan"),
                "strict_change_ci": bootstrap_interval([v - f for v, f in zip(strict, strict_references)]),
                "parse_failures": sum(run["parse_failures"] for run in runs),
                "questions_with_failures": sum(run["parse_failures"] > 0 for run in runs),
                "mean_steps": sum(run["steps"] for run in runs) / len(runs) if runs else float("nan"),
                "natural_calls": sum(bool(run["natural_call"]) for run in runs),
                "forced": sum(run["forced"] for run in runs),
                "forced_failed": sum(run["forced_failed"] for run in runs),
                "second_searches": sum(run.get("search_steps", 0) >= 2 for run in runs),
                "out_of_steps": sum(bool(run.get("out_of_steps")) for run in runs),
                "closed_book_correct": sum(run["closed_book_correct"] or 0 for run in runs),
                "tool_markup_in_answer": sum(run["tool_markup_in_answer"] for run in runs),
                "calls_as_text": sum(call_as_text(t) for t in turns if not t.get("shared")),
                "answers_as_call_text": sum(bool(CALL_AS_TEXT.search(run["answer"])) for run in runs),
                "gold_found": sum(run["gold_found"] for run in runs),
                "gold_total": sum(run["gold_total"] for run in runs),
                "turns_with_results": len(with_results),
                "compressed": sum(bool(t["compressed"]) for t in with_results),
                "kept_document_share": (
                    sum(t["keep_rate"] for t in with_results) / len(with_results) if with_results else float("nan")
                ),
                "uncompressed_reasons": dict(
                    Counter(t["uncompressed_reason"] for t in with_results if not t["compressed"])
                ),
            }
        )
    return rows


def step_rows(report: dict) -> list[dict]:
    """One row per (step, tool_choice, keep rate): TTFT median and IQR, prompt tokens, kept share, and the
    TTFT speed-up against keep 1.0 over the questions where both ran that turn (ratio of medians, and the
    median of the per-question ratios)."""
    rates = report["settings"]["keep_rates"]
    full = rate_key(1.0) if 1.0 in rates else rate_key(max(rates))

    def turn(record: dict, key: str, step: int, choice: str) -> dict | None:
        run = record["runs"].get(key)
        return (
            next((t for t in run["turns"] if t["step"] == step and t["tool_choice"] == choice), None) if run else None
        )

    kinds = sorted(
        {(t["step"], t["tool_choice"]) for r in report["records"] for run in r["runs"].values() for t in run["turns"]},
        key=lambda kind: (kind[0], ["auto", "required", "none"].index(kind[1])),
    )
    rows = []
    for step, choice in kinds:
        for rate in rates:
            key = rate_key(rate)
            turns = [t for r in report["records"] if (t := turn(r, key, step, choice)) and not t.get("shared")]
            if not turns:
                continue
            ttft = [t["ttft_ms"] for t in turns]
            q1, median, q3 = quartiles(ttft)
            pairs = [
                (f["ttft_ms"], t["ttft_ms"])
                for r in report["records"]
                if (t := turn(r, key, step, choice))
                and (f := turn(r, full, step, choice))
                and not (t.get("shared") or f.get("shared"))
            ]
            rows.append(
                {
                    "step": step,
                    "tool_choice": choice,
                    "keep_rate": rate,
                    "n": len(turns),
                    "ttft_median": median,
                    "ttft_q1": q1,
                    "ttft_q3": q3,
                    "prompt_tokens": statistics.median(t["prompt_tokens"] for t in turns),
                    "document_tokens": statistics.median(t["document_tokens"] for t in turns),
                    "kept_share": sum(t["kept_share"] for t in turns) / len(turns),
                    "kept_document_share": sum(t["keep_rate"] for t in turns) / len(turns),
                    "compressed": sum(bool(t["compressed"]) for t in turns),
                    "reasons": dict(Counter(t["uncompressed_reason"] for t in turns if not t["compressed"])),
                    "draft_ms": statistics.median(t["draft_ms"] for t in turns),
                    "n_paired": len(pairs),
                    "speedup": (
                        statistics.median(f for f, _ in pairs) / statistics.median(t for _, t in pairs)
                        if pairs
                        else float("nan")
                    ),
                    "speedup_paired": statistics.median(f / t for f, t in pairs) if pairs else float("nan"),
                }
            )
    return rows


def _interval(low: float, high: float, percent: bool = False) -> str:
    if math.isnan(low):
        return "n/a"
    return f"{low:.0%} to {high:.0%}" if percent else f"{low:+.2f} to {high:+.2f}"


def failure_examples(report: dict, limit: int = 6) -> list[str]:
    """The raw text of turns whose calls did not parse, and of step-1 turns that answered without searching."""
    broken, silent, plain = [], [], []
    for record in report["records"]:
        for key, run in record["runs"].items():
            for t in run["turns"]:
                where = f"question {record['question']}, keep {key}, step {t['step']} ({t['tool_choice']})"
                if t["invalid_tool_calls"]:
                    errors = "; ".join(c["error"] for c in t["invalid_tool_calls"])
                    broken.append(f"- {where}: {errors}. Raw: `{_quote(t['raw'])}`")
                elif call_as_text(t) and not t.get("shared"):
                    plain.append(f"- {where}: `{_quote(t['raw'])}`")
                elif t["step"] == 1 and t["tool_choice"] == "auto" and not t["tool_calls"] and key == "1":
                    silent.append(f"- {where}: `{_quote(t['raw'])}`")
    lines = []
    if broken:
        lines += ["", f"Tool calls that did not parse ({len(broken)}; first {min(limit, len(broken))}):", ""]
        lines += broken[:limit]
    if plain:
        lines += [
            "",
            f"Calls written as plain text, outside the markup ({len(plain)}; first {min(limit, len(plain))}):",
            "",
        ]
        lines += plain[:limit]
    if silent:
        lines += ["", f"Step 1 without a call, keep 1 ({len(silent)}; first {min(limit, len(silent))}):", ""]
        lines += silent[:limit]
    return lines


def _share(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.0%}"


def _ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def _quote(text: str, limit: int = 300) -> str:
    text = " ".join(text.split()).replace("`", "'").replace("|", "\\|")
    return text if len(text) <= limit else text[:limit] + " ..."


def markdown(report: dict) -> str:
    meta, settings = report["meta"], report["settings"]
    sessions = report["sessions"]
    loads = ", ".join(
        f"{s['load_start'][0]:.1f} -> {s['load_end'][0]:.1f}" for s in sessions if s.get("load_end") is not None
    )
    per_question = [r["load_before"][0] for r in report["records"]] + [r["load_after"][0] for r in report["records"]]
    load_range = f"{min(per_question):.1f}-{max(per_question):.1f}" if per_question else "n/a"
    lines = [
        f"HotpotQA distractor, {len(report['records'])} questions (seed {settings['seed']}); main {settings['main']}, "
        f"draft {settings['draft']} ({meta['draft_path']} path), {meta['torch_dtype']}; search top-{settings['top_k']} "
        f"of 10 paragraphs by BM25; at most {settings['max_steps']} steps, the last with tool_choice 'none'; "
        f"{settings['max_new_tokens']} new tokens per tool turn, {settings['answer_tokens']} for the answer turn; "
        f"chunks of {settings.get('chunking', 'tokens')}; "
        f"min_prompt_tokens {settings['min_prompt_tokens']} (resolved {meta['min_prompt_tokens']}; 'auto' would be "
        f"{meta['auto_min_prompt_tokens']}), draft prefix cache {settings['draft_cache_mb']} MB.",
        "",
        f"Machine: {meta['machine']}. Load average (1 min) at session start -> end: {loads or 'n/a'}; before/after "
        f"each question {load_range}. Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        "",
        "Keep rates run back to back per question, in a rotating order; TTFT ratios are paired within questions."
        + (
            " Step 1 (no tool result yet: the same whole prompt at every keep rate) is generated once per question, at "
            "the first keep rate of its order, and shared: its rows count the turns measured at that rate."
            if settings.get("share_first_step")
            else ""
        ),
        "",
        "| keep | n | correct | retention (95% CI) | change vs keep 1 (95% CI) | correct, call-text answers "
        "not counted (change vs keep 1, 95% CI) | parse failures (questions) "
        "| mean steps | natural calls | forced (failed) | searched at 2+ steps | answer forced at the step cap "
        "| gold paragraphs found | result turns compressed | kept document share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary_rows(report):
        low, high = row["retention_ci"]
        lines.append(
            f"| {row['keep_rate']:g} | {row['n']} | {row['correct']:g} ({row['accuracy']:.0%}) "
            f"| {_share(row['retention'])} ({_interval(low, high, percent=True)}) "
            f"| {row['change']:+.2f} ({_interval(*row['change_ci'])}) "
            f"| {row['strict_correct']:g} ({row['strict_change']:+.2f}, {_interval(*row['strict_change_ci'])}) "
            f"| {row['parse_failures']} ({row['questions_with_failures']}) | {row['mean_steps']:.2f} "
            f"| {row['natural_calls']}/{row['n']} | {row['forced']} ({row['forced_failed']}) "
            f"| {row['second_searches']} | {row['out_of_steps']} "
            f"| {row['gold_found']}/{row['gold_total']} | {row['compressed']}/{row['turns_with_results']} "
            f"| {row['kept_document_share']:.2f} |"
        )
    extra = summary_rows(report)
    closed = ", ".join(f"keep {r['keep_rate']:g}: {r['closed_book_correct']:g}" for r in extra)
    markup = sum(r["tool_markup_in_answer"] for r in extra)
    plain = ", ".join(f"keep {r['keep_rate']:g}: {r['calls_as_text']} ({r['answers_as_call_text']})" for r in extra)
    unsearched = (
        f"Correct answers given at step 1 without searching (before the forced search): {closed}. "
        if settings.get("force_search", True)
        else ""
    )
    lines += [
        "",
        unsearched
        + f"Final answers holding tool-call markup: {markup}. Turns that wrote a search call as plain text outside "
        f"the tool-call markup (not parsed, so not a parse failure; in parentheses: final answers that are such "
        f"text): {plain}.",
        "",
        "| step | tool_choice | keep | n | TTFT median ms | IQR ms | prompt tokens (median) | document tokens "
        "| kept share of prompt | kept document share | compressed | draft ms | speed-up vs keep 1 (ratio of "
        "medians) | median paired ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in step_rows(report):
        reasons = ", ".join(f"{k}: {v}" for k, v in row["reasons"].items())
        compressed = f"{row['compressed']}/{row['n']}" + (f" ({reasons})" if reasons else "")
        lines.append(
            f"| {row['step']} | {row['tool_choice']} | {row['keep_rate']:g} | {row['n']} | {row['ttft_median']:,.0f} "
            f"| {row['ttft_q1']:,.0f}-{row['ttft_q3']:,.0f} | {row['prompt_tokens']:,.0f} "
            f"| {row['document_tokens']:,.0f} | {row['kept_share']:.2f} | {row['kept_document_share']:.2f} "
            f"| {compressed} | {row['draft_ms']:,.0f} | {_ratio(row['speedup'])} ({row['n_paired']} paired) "
            f"| {_ratio(row['speedup_paired'])} |"
        )
    return "\n".join(lines + failure_examples(report)) + "\n"


# -- the run --------------------------------------------------------------------------------------------


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "specprefill-rag", "xgrammar"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def machine() -> str:
    from ttft import cpu_model

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{cpu_model()}, {os.cpu_count()} CPU cores ({torch.get_num_threads()} torch threads)"


def auto_floor(engine: Any) -> int | None:
    """What min_prompt_tokens='auto' resolves to for this engine's pair."""
    from specprefill_rag.draft.cost import parameter_count, pays_from

    share = parameter_count(engine.draft.model) / parameter_count(engine.main.model)
    return pays_from(share, engine.config.effective_look_ahead)


def build_engine(args: argparse.Namespace) -> Any:
    from specprefill_rag import SpecPrefillEngine

    return SpecPrefillEngine(
        main=args.main,
        draft=args.draft,
        dtype=args.dtype,
        min_prompt_tokens=args.min_prompt_tokens,
        draft_cache_mb=args.draft_cache_mb,
        lazy_tool_grammar=args.lazy_tool_grammar,
        chunking=args.chunking,
    )


def resumed(args: argparse.Namespace, path: Path, digests: list[str]) -> dict | None:
    """The earlier run at ``path`` (``--resume``), or None; refused when its settings or questions differ."""
    if not args.resume or not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    differing = [k for k in STUDY if earlier["settings"].get(k) != vars(args).get(k)]
    if differing:
        raise SystemExit(f"--resume: {path} was run with other settings ({differing}); use another --out")
    for record in earlier["records"]:
        if record["question"] >= len(digests) or record["digest"] != digests[record["question"]]:
            raise SystemExit(
                f"--resume: question {record['question']} is not the one the earlier run asked; "
                f"use --questions of at least {max(r['question'] for r in earlier['records']) + 1} and the same --seed"
            )
    return earlier


def min_prompt_tokens(value: str) -> int | str:
    return value if value == "auto" else int(value)


def parse(argv: list[str] | None) -> argparse.Namespace:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--questions", type=int, default=30)
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--main", default=MAIN)
    options.add_argument("--draft", default=DRAFT)
    options.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    options.add_argument("--keep-rates", type=float, nargs="+", default=KEEP_RATES)
    options.add_argument("--top-k", type=int, default=3, help="paragraphs a search returns")
    options.add_argument("--max-steps", type=int, default=3, help="model turns per question (at least 2)")
    options.add_argument("--max-new-tokens", type=int, default=64, help="per turn that may call the tool")
    options.add_argument("--answer-tokens", type=int, default=32, help="for the last turn (tool_choice 'none')")
    options.add_argument("--min-prompt-tokens", type=min_prompt_tokens, default=0, help="a number or 'auto'")
    options.add_argument("--draft-cache-mb", type=int, default=0, help="0: every draft call scored cold")
    options.add_argument("--system", default=SYSTEM, help="the system prompt")
    options.add_argument(
        "--force-search",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a step 1 without a call is scored, then one search is forced (tool_choice 'required'; issue #30)",
    )
    options.add_argument(
        "--chunking",
        default="sentences",
        choices=["tokens", "sentences"],
        help="the engine's chunking (runs recorded without it used 'tokens', the default then)",
    )
    options.add_argument(
        "--lazy-tool-grammar",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's lazy_tool_grammar: tool_choice 'auto' constrains a call once the answer starts one",
    )
    options.add_argument(
        "--share-first-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate step 1 (no tool result yet: the same prompt at every keep rate) once per question",
    )
    options.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "agentic" / "hotpotqa")
    options.add_argument("--resume", action="store_true", help="keep the questions an earlier run saved at --out")
    options.add_argument("--report", action="store_true", help="rewrite <out>.md from <out>.json; run nothing")
    options.add_argument(
        "--reparse",
        action="store_true",
        help="with --report: print the report with every turn's output parsed by today's tool-call parser",
    )
    args = options.parse_args(argv)
    if args.max_steps < 2:
        options.error("--max-steps must be at least 2: a search, then the answer")
    args.sampler = tasks.sampler_version("hotpotqa")
    return args


def main(argv: list[str] | None = None, engine: Any = None) -> dict:
    """Run the study (``engine``: one already built, e.g. a test's tiny model; default: --main and --draft)."""
    args = parse(argv)
    if args.report:
        report = json.loads(Path(f"{args.out}.json").read_text())
        if args.reparse:
            report = reparsed(report)
            print(markdown(report))
        else:
            Path(f"{args.out}.md").write_text(markdown(report))
        return report
    samples = load_questions(args.questions, args.seed)
    digests = [sample_digest({k: v for k, v in s.items() if k != "paragraphs"}) for s in samples]
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    path = Path(f"{out}.json")
    earlier = resumed(args, path, digests)
    engine = engine if engine is not None else build_engine(args)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta = {
        "machine": machine(),
        "torch_dtype": str(engine.main.model.dtype).removeprefix("torch."),
        "draft_path": engine.draft_path,
        "tool_format": tool_call_format(engine.tokenizer.chat_template),
        "min_prompt_tokens": engine.min_prompt_tokens,
        "auto_min_prompt_tokens": auto_floor(engine),
        "versions": versions(),
    }
    session = {"started": now(), "load_start": list(os.getloadavg()), "ended": None, "load_end": None}
    report = earlier or {"study": "agentic-hotpotqa", "records": [], "sessions": []}
    report.update(
        settings={**settings, "questions": max(args.questions, report.get("settings", {}).get("questions", 0))}
    )
    report["meta"] = meta
    report["sessions"].append(session)

    def save(partial: dict) -> None:
        path.write_text(json.dumps(partial, indent=1))
        Path(f"{out}.md").write_text(markdown(partial))

    report = run(engine, samples, args, report, save)
    report["sessions"][-1].update(ended=now(), load_end=list(os.getloadavg()))
    save(report)
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
