"""A two-step HotpotQA agent, its first tool result frozen or reselected at the answer step (issue #27).

The agent of ``benchmarks/agentic.py`` (one ``search`` tool over the question's 10 paragraphs, BM25 top
``--top-k``), made to take two hops: step 1 and step 2 each force one search (``tool_choice="required"``),
step 3 answers (``"none"``): with ``--answer-format json`` (the default) as a JSON object ``{"answer": ...}``
enforced by the constrained decoder, with ``text`` its first line. (In text the 1.5B Coder mostly wrote another
call as text or nothing at step 3, 2 of 20 right in every arm: the comparison said nothing.) Step 1 sees no
tool result (prefilled whole: generated once per question); step 2 is the first turn that compresses
result 1, so it is the same prompt and selection for both arms and runs once per keep rate, on the frozen
engine. Step 3 holds both results:

* ``frozen@k``: stable selection (``reselect=False``): result 1 keeps the tokens step 2 chose for it;
  result 2 is scored against the step-3 query;
* ``reselect@k``: both results scored again at step 3 (``reselect=True``, the engine's default);
* ``full``: the same step-3 prompt prefilled whole (keep 1.0): what the model answers from whole results, the
  ceiling both arms are read against.

Per question and keep rate: each arm's answer and its correctness (normalised containment of a gold answer,
benchmarks/quality.py's ``contains``), the spans step 3 reused, TTFT and draft time. The report: correct
per arm and the paired difference frozen - reselected with a 95% bootstrap interval over questions.

    python benchmarks/agent_reselect.py --questions 30 --out benchmarks/results/conversation/agent-hotpotqa

Writes ``<out>.json`` and ``<out>.md`` after every question; a rerun resumes from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentic import SEARCH, SYSTEM, load_questions, query_of, search  # noqa: E402
from document_cache_speed import UNCACHED, machine  # noqa: E402
from quality import bootstrap_interval, scores  # noqa: E402

from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.config import OutputFormat  # noqa: E402
from specprefill_rag.models.loading import load_model  # noqa: E402
from specprefill_rag.prompt.chat import ChatMessage  # noqa: E402
from specprefill_rag.results import ToolCall  # noqa: E402

ANSWER = OutputFormat(
    "json_schema",
    schema={"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
)
FIELDS = ("ttft_ms", "draft_ms", "prompt_tokens", "kept_tokens", "compressed", "uncompressed_reason", "reused_spans")


def record(result: Any) -> dict:
    return {name: getattr(result.stats, name, None) for name in FIELDS}


def search_step(engine: SpecPrefillEngine, messages: list, step: int, keep: float, sample: dict, args) -> dict:
    """One forced search at ``keep``: the turn's record, and ``messages`` grown by the call and its result."""
    result = engine.chat(
        messages,
        tools=[SEARCH],
        tool_choice="required",
        parallel_tool_calls=False,
        keep_rate=keep,
        max_new_tokens=args.max_new_tokens,
    )
    calls = result.tool_calls
    if not calls:
        return {"step": step, "failed": True, "text": result.text} | record(result)
    call = ToolCall(calls[0].name, dict(calls[0].arguments), f"call_{step}")
    query = query_of(call.arguments)
    text, chosen = search(sample, query, args.top_k)
    messages += [ChatMessage("assistant", [], (call,)), ChatMessage("tool", [text], tool_call_id=call.id)]
    return {"step": step, "failed": False, "query": query, "returned": chosen} | record(result)


def answer_step(engine: SpecPrefillEngine, messages: list, keep: float, sample: dict, args) -> dict:
    constrained = args.answer_format == "json"
    result = engine.chat(
        messages,
        tools=[SEARCH],
        tool_choice="none",
        keep_rate=keep,
        max_new_tokens=args.answer_tokens,
        **({"output_format": ANSWER} if constrained else {"stop": ["\n"]}),
    )
    answer = answer_of(result.text) if constrained else result.text.strip()
    return {"answer": answer, "correct": scores(answer, sample["answers"])["contains"]} | record(result)


def answer_of(text: str) -> str:
    """The ``answer`` field of a constrained step-3 reply; the raw text where it was cut off by the token limit."""
    try:
        return str(json.loads(text)["answer"]).strip()
    except (ValueError, KeyError, TypeError):
        return text.strip()


def question(engines: dict[str, SpecPrefillEngine], sample: dict, number: int, args) -> dict:
    """Steps 1-2 once, step 3 on both arms (their order alternating between questions), at every keep rate."""
    for engine in engines.values():
        engine.pipeline.memo.clear()
    opening = [ChatMessage("system", [SYSTEM]), ChatMessage("user", [sample["question"]])]
    first = list(opening)
    step_1 = search_step(engines["frozen"], first, 1, 1.0, sample, args)
    row: dict[str, Any] = {"question": sample["question"], "answers": sample["answers"], "step_1": step_1}
    if step_1["failed"]:
        return row
    for keep in args.keeps:
        messages = list(first)
        step_2 = search_step(engines["frozen"], messages, 2, keep, sample, args)
        arms = {"step_2": step_2}
        if not step_2["failed"]:
            for name in ("frozen", "reselect")[:: 1 if number % 2 else -1]:
                arms[name] = answer_step(engines[name], messages, keep, sample, args)
            if args.full:
                arms["full"] = answer_step(engines["frozen"], messages, 1.0, sample, args)
        row[f"{keep:g}"] = arms
    return row


def summary(report: dict) -> str:
    records, settings = report["records"], report["settings"]
    lines = [
        f"Settings: `{json.dumps(settings)}`",
        f"Machine: `{json.dumps(report['machine'])}`",
        "",
        "| keep | questions (both arms answered) | full correct | frozen correct | reselected correct | "
        "frozen - reselected (95% CI) | answers differ | step-3 spans reused (frozen, total) | "
        "step-3 TTFT ms frozen / reselected (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for keep in settings["keeps"]:
        pairs = [r[f"{keep:g}"] for r in records if f"{keep:g}" in r and "frozen" in r[f"{keep:g}"]]
        if not pairs:
            continue
        frozen = [p["frozen"]["correct"] for p in pairs]
        reselected = [p["reselect"]["correct"] for p in pairs]
        differences = [a - b for a, b in zip(frozen, reselected)]
        low, high = bootstrap_interval(differences)
        ttft = [sorted(p[arm]["ttft_ms"] for p in pairs)[len(pairs) // 2] for arm in ("frozen", "reselect")]
        full = [p["full"]["correct"] for p in pairs if "full" in p]
        full_cell = f"{sum(full):.0f} ({sum(full) / len(full):.0%})" if full else "-"
        lines.append(
            f"| {keep:g} | {len(pairs)} | {full_cell} | {sum(frozen):.0f} ({sum(frozen) / len(pairs):.0%}) | "
            f"{sum(reselected):.0f} ({sum(reselected) / len(pairs):.0%}) | "
            f"{sum(differences) / len(pairs):+.3f} ({low:+.3f} to {high:+.3f}) | "
            f"{sum(p['frozen']['answer'] != p['reselect']['answer'] for p in pairs)} | "
            f"{sum(p['frozen']['reused_spans'] or 0 for p in pairs)} | {ttft[0]:,.0f} / {ttft[1]:,.0f} |"
        )
    failed = sum(r["step_1"]["failed"] for r in records)
    lines += ["", f"Questions whose forced step-1 search produced no call (left out): {failed} of {len(records)}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--questions", type=int, default=30)
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--main", default="qwen2.5-coder-1.5b")
    options.add_argument("--draft", default="qwen2.5-coder-0.5b")
    options.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    options.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    options.add_argument("--top-k", type=int, default=3)
    options.add_argument("--max-new-tokens", type=int, default=64)
    options.add_argument("--answer-tokens", type=int, default=32)
    options.add_argument("--answer-format", choices=["json", "text"], default="json")
    options.add_argument("--full", action=argparse.BooleanOptionalAction, default=True)
    options.add_argument("--threads", type=int, default=2)
    options.add_argument("--out", type=Path, required=True)
    args = options.parse_args()
    torch.set_num_threads(args.threads)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "threads", "questions")}
    path = args.out.with_suffix(".json")
    report = json.loads(path.read_text()) if path.exists() else {"settings": settings, "records": []}
    if report["settings"] != settings:
        raise SystemExit(f"{path} was run with other settings: {report['settings']}")
    report.setdefault("machine", []).append(machine())
    main_loaded, draft_loaded = load_model(args.main, "cpu", args.dtype), load_model(args.draft, "cpu", args.dtype)
    engines = {
        name: SpecPrefillEngine.from_models(
            main_loaded.model, main_loaded.tokenizer, draft_loaded.model, reselect=name == "reselect", **UNCACHED
        )
        for name in ("frozen", "reselect")
    }
    samples = load_questions(args.questions, args.seed)
    for number, sample in enumerate(samples):
        if number < len(report["records"]):
            continue
        report["records"].append(question(engines, sample, number, args))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(summary(report))
        print(
            json.dumps(
                {"question": number} | {k: v for k, v in report["records"][-1].items() if k in ("0.1", "0.3")},
                default=str,
            )[:400],
            flush=True,
        )


if __name__ == "__main__":
    main()
