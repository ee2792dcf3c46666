"""Conversations over the same documents: stable selection and the main-model prefix cache (issue #27).

A conversation is a SQuAD v1.1 paragraph with several questions (read in place from ../shared/data), put
among paragraphs of other articles; turn 1's user message holds the documents and the first question,
each later turn appends the previous answer (assistant message) and the next question. The documents stay
where turn 1 wrote them (``documents=`` only locates them), so turn ``t`` is a prefix of turn ``t + 1``.

``speed``: per turn, TTFT of these arms, each its own engine over the same models, run side by side in one
process, in an order that rotates from turn to turn:

* ``full``: keep 1.0, main prefix cache off (a plain full prefill: the same cost every turn, so it runs at
  the first and last turn only, ``--full-turns``);
* ``full-cached``: keep 1.0 with the main prefix cache (what a prefix-caching server gives without SpecPrefill);
* ``reselect@k``: "today's SpecPrefill": ``reselect=True``, ``main_cache_mb=0`` (the draft prefix cache on);
* ``stable@k``: stable selection (``reselect=False``, set explicitly: the engine's default became
  ``reselect=True`` after these runs) and the main prefix cache.

Every arm sees the same prompts: the answer appended to the history is ``full-cached``'s (a full prefill's
answer, ``--answer-tokens`` tokens, greedy); the other arms generate one token. ``--dtype`` defaults to
float32: on the 2-core Xeon without AMX it prefilled 1.45x faster than bfloat16.
Prefix caches are shared per (device, size) in a process, so every engine gets its own sizes
(``stable@0.1``: main 1024 MiB, draft 2047; ``speed_arms``) and no arm hits another's entries; all caches
and memos are cleared between conversations (their bytes are recorded per turn first).

``quality``: the same kind of conversations (``--documents`` passages, ``--questions`` questions each),
``frozen`` (``reselect=False``) against ``reselect=True`` at each keep rate, on the same samples, each arm its own
history (its own answers). Turn 1 is the same prompt and selection for both (nothing to recall yet), so it
runs once, on the frozen engine, and is shared. Correctness: benchmarks/quality.py's ``contains`` (normalised
containment of a gold answer). The paired difference frozen - reselected over turns 2+ gets a 95% bootstrap
interval over conversations (the turns of a conversation are drawn together).

    python benchmarks/conversation.py speed --conversations 5 --out benchmarks/results/conversation/speed
    python benchmarks/conversation.py quality --conversations 30 --out benchmarks/results/conversation/quality
    python benchmarks/conversation.py quality ... --resume     # continue a stopped run
    python benchmarks/conversation.py speed --report --out ... # the .md from the .json

Both write ``<out>.json`` (every record) and ``<out>.md`` (the tables) after every conversation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import: a model that is not installed fails, never downloads
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tasks  # noqa: E402
from quality import bootstrap_interval, sample_digest, scores  # noqa: E402

from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.prompt.chat import ChatMessage  # noqa: E402

ROOT = tasks.ROOT
MAIN = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
SYSTEM = "Answer the question using the documents. Answer with a short phrase."
STAT_FIELDS = (
    "ttft_ms",
    "draft_ms",
    "main_prefill_ms",
    "prompt_tokens",
    "document_tokens",
    "kept_tokens",
    "kept_document_tokens",
    "compressed",
    "uncompressed_reason",
    "reused_spans",
    "main_cached_tokens",
    "draft_cached_tokens",
    "draft_document_cached_tokens",
    "completion_tokens",
)


def speed_arms(keep_rates: list[float]) -> dict[str, dict]:
    """Engine settings per arm; a distinct (main, draft) cache size per engine, so no two share a cache."""
    arms = {
        "full": dict(keep_rate=1.0, main_cache_mb=0, draft_cache_mb=0),
        "full-cached": dict(keep_rate=1.0, main_cache_mb=1000, draft_cache_mb=0),
    }
    main_sizes, draft_sizes = iter(range(1024, 0, -1)), iter(range(2048, 0, -1))
    for keep in keep_rates:
        arms[f"reselect@{keep:g}"] = dict(
            keep_rate=keep, reselect=True, main_cache_mb=0, draft_cache_mb=next(draft_sizes)
        )
        arms[f"stable@{keep:g}"] = dict(
            keep_rate=keep, reselect=False, main_cache_mb=next(main_sizes), draft_cache_mb=next(draft_sizes)
        )
    return arms


def quality_arms(keep_rates: list[float]) -> dict[str, dict]:
    arms = {}
    for keep in keep_rates:
        arms[f"frozen@{keep:g}"] = dict(keep_rate=keep, reselect=False)
        arms[f"reselect@{keep:g}"] = dict(keep_rate=keep, reselect=True)
    return arms


# -- conversations ----------------------------------------------------------------------------------


def squad_conversations(
    count: int,
    questions: int,
    seed: int,
    n_documents: int | None = None,
    document_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> list[dict]:
    """``count`` SQuAD paragraphs with at least ``questions`` questions (their first ``questions``, in order),
    each among paragraphs of other articles at a random depth: ``n_documents`` in all, or as many as make
    ``document_tokens`` (``count_tokens`` counts them)."""
    articles = json.loads((tasks.DATA / "squad" / "dev-v1.1.reconstructed.json").read_text())["data"]
    rng = random.Random(seed)
    candidates = [
        (a, p)
        for a, article in enumerate(articles)
        for p, paragraph in enumerate(article["paragraphs"])
        if len(paragraph["qas"]) >= questions
    ]
    if len(candidates) < count:
        raise SystemExit(f"only {len(candidates)} paragraphs have {questions} questions")
    rng.shuffle(candidates)
    conversations = []
    for article, index in candidates[:count]:
        paragraph = articles[article]["paragraphs"][index]
        others = [a for i, a in enumerate(articles) if i != article]
        distractors: list[str] = []
        total = count_tokens(paragraph["context"]) if document_tokens else 0
        available = len({p["context"] for other in others for p in other["paragraphs"]})
        while ((len(distractors) + 1 < n_documents) if n_documents else (total < document_tokens)) and len(
            distractors
        ) < available:
            text = rng.choice(rng.choice(others)["paragraphs"])["context"]
            if text in distractors:
                continue
            distractors.append(text)
            total += count_tokens(text) if document_tokens else 0
        depth = rng.randrange(len(distractors) + 1)
        qas = paragraph["qas"][:questions]
        conversations.append(
            {
                "questions": [qa["question"] for qa in qas],
                "answers": [[a["text"] for a in qa["answers"]] for qa in qas],
                "documents": distractors[:depth] + [paragraph["context"]] + distractors[depth:],
                "gold_document": depth,
            }
        )
    return conversations


def opening(conversation: dict) -> list[ChatMessage]:
    """Turn 1 as the history keeps it: the documents written into the first user message."""
    text = "\n\n".join(conversation["documents"]) + "\n\n" + conversation["questions"][0]
    return [ChatMessage("system", [SYSTEM]), ChatMessage("user", [text])]


def next_turn(history: list[ChatMessage], answer: str, question: str) -> list[ChatMessage]:
    return [*history, ChatMessage("assistant", [answer]), ChatMessage("user", [question])]


def stats_record(result) -> dict:
    return {name: getattr(result.stats, name, None) for name in STAT_FIELDS}


def cache_bytes(engine: SpecPrefillEngine) -> dict[str, int]:
    """Bytes held by the engine's main prefix cache, selection memo and draft prefix cache (0 when off)."""
    main = getattr(engine.backend, "prefix_cache", None)
    draft = getattr(engine.draft, "prefix_cache", None)
    return {
        "main_cache": main.nbytes if main is not None else 0,
        "memo": engine.pipeline.memo.nbytes,
        "draft_cache": draft.nbytes if draft is not None else 0,
    }


def clear(engine: SpecPrefillEngine) -> None:
    for cache in (getattr(engine.backend, "prefix_cache", None), getattr(engine.draft, "prefix_cache", None)):
        if cache is not None:
            cache.clear()
    engine.pipeline.memo.clear()


def rotated(names: list[str], by: int) -> list[str]:
    by %= len(names)
    return names[by:] + names[:by]


# -- speed ------------------------------------------------------------------------------------------


def speed_conversation(
    engines: dict[str, SpecPrefillEngine],
    conversation: dict,
    number: int,
    answer_tokens: int,
    full_turns: list[int] | None = None,
    answer_arm: str = "full-cached",
) -> dict:
    """Every turn of one conversation on every arm; the history grows with ``answer_arm``'s answers (a full
    prefill's). ``full`` (a full prefill without the cache, the same cost every turn) runs only at
    ``full_turns`` (1-based; None: every turn)."""
    for engine in engines.values():
        clear(engine)
    history = opening(conversation)
    turns = []
    for turn, question in enumerate(conversation["questions"]):
        if turn:
            history = next_turn(history, turns[-1]["answer"], question)
        row: dict[str, Any] = {"turn": turn + 1, "question": question}
        names = [n for n in engines if n != "full" or full_turns is None or turn + 1 in full_turns]
        order = rotated(names, number + turn)
        for name in order:
            tokens = answer_tokens if name == answer_arm else 1
            result = engines[name].chat(history, documents=conversation["documents"], max_new_tokens=tokens)
            row[name] = stats_record(result)
            if name == answer_arm:
                row["answer"] = result.text.strip()
        row["order"] = order
        row["memory"] = {name: cache_bytes(engine) for name, engine in engines.items()}
        turns.append(row)
        print(
            json.dumps({k: row[k] for k in ("turn", "answer")} | {n: round(row[n]["ttft_ms"]) for n in order}),
            flush=True,
        )
    return {"conversation": number, "digest": sample_digest(conversation), "turns": turns}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def speed_summary(report: dict) -> dict:
    conversations = report["conversations"]
    arms = list(report["arms"])
    turns = min(len(c["turns"]) for c in conversations) if conversations else 0
    keeps = [name.split("@")[1] for name in arms if name.startswith("stable@")]
    summary = []
    for t in range(turns):
        rows = [c["turns"][t] for c in conversations]
        entry: dict[str, Any] = {
            "turn": t + 1,
            "prompt_tokens": spread([r["full-cached"]["prompt_tokens"] for r in rows]),
            "ttft_ms": {name: spread([r[name]["ttft_ms"] for r in rows]) for name in arms if name in rows[0]},
            "ratios": {},
            "stats": {},
        }
        if t:
            entry["new_tokens"] = spread(
                [
                    r["full-cached"]["prompt_tokens"] - c["turns"][t - 1]["full-cached"]["prompt_tokens"]
                    for r, c in zip(rows, conversations)
                ]
            )
        for keep in keeps:
            stable, reselect = f"stable@{keep}", f"reselect@{keep}"
            entry["ratios"][f"{reselect} / {stable}"] = spread(
                [r[reselect]["ttft_ms"] / r[stable]["ttft_ms"] for r in rows]
            )
            if "full" in rows[0]:
                entry["ratios"][f"full / {stable}"] = spread(
                    [r["full"]["ttft_ms"] / r[stable]["ttft_ms"] for r in rows]
                )
                entry["ratios"][f"full / {reselect}"] = spread(
                    [r["full"]["ttft_ms"] / r[reselect]["ttft_ms"] for r in rows]
                )
            entry["ratios"][f"full-cached / {stable}"] = spread(
                [r["full-cached"]["ttft_ms"] / r[stable]["ttft_ms"] for r in rows]
            )
            # The token bound: tokens the reselecting arm's main model prefills over those the stable arm's does.
            entry["ratios"][f"token bound {keep}"] = spread(
                [
                    r[reselect]["kept_tokens"]
                    / max(1, r[stable]["kept_tokens"] - (r[stable]["main_cached_tokens"] or 0))
                    for r in rows
                ]
            )
        for name in arms:
            if name not in rows[0]:
                continue
            stats = {}
            for field in ("draft_ms", "kept_tokens", "main_cached_tokens", "reused_spans", "draft_cached_tokens"):
                values = [r[name][field] or 0 for r in rows]
                stats[field] = spread(values)
            stats["prefilled_tokens"] = spread(
                [r[name]["kept_tokens"] - (r[name]["main_cached_tokens"] or 0) for r in rows]
            )
            stats["memory"] = {
                k: spread([r["memory"][name][k] for r in rows]) for k in ("main_cache", "memo", "draft_cache")
            }
            entry["stats"][name] = stats
        summary.append(entry)
    return {"turns": summary}


def _ms(s: dict) -> str:
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def _x(s: dict) -> str:
    return f"{s['median']:.1f}x ({s['min']:.1f}-{s['max']:.1f})"


def speed_markdown(report: dict) -> str:
    summary = report["summary"]["turns"]
    arms = list(report["arms"])
    n = len(report["conversations"])
    lines = [
        f"TTFT ms per turn, median (min-max) over {n} conversations; `uptime` before: "
        f"{report.get('load_before', '?')}; after: {report.get('load_after', '?')}",
        "",
        "| turn | prompt tokens | " + " | ".join(arms) + " |",
        "|---|---|" + "---|" * len(arms),
    ]
    for e in summary:
        lines.append(
            f"| {e['turn']} | {e['prompt_tokens']['median']:,.0f} | "
            + " | ".join(_ms(e["ttft_ms"][a]) if a in e["ttft_ms"] else "-" for a in arms)
            + " |"
        )
    ratio_names = list(dict.fromkeys(r for e in summary for r in e["ratios"]))
    lines += [
        "",
        "TTFT ratios per turn, median (min-max) over conversations (each conversation's arms side by side)",
        "",
        "| turn | new tokens | " + " | ".join(ratio_names) + " |",
        "|---|---|" + "---|" * len(ratio_names),
    ]
    for e in summary:
        new = f"{e['new_tokens']['median']:,.0f}" if "new_tokens" in e else "-"
        lines.append(
            f"| {e['turn']} | {new} | "
            + " | ".join(_x(e["ratios"][r]) if r in e["ratios"] else "-" for r in ratio_names)
            + " |"
        )
    lines += [
        "",
        "Stats per turn, medians: draft ms / kept tokens / main-cached tokens / prefilled (kept - cached) "
        "/ reused spans / draft-cached tokens",
        "",
        "| turn | arm | draft ms | kept | main cached | prefilled | reused spans | draft cached |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in summary:
        for a in arms:
            if a not in e["stats"]:
                continue
            s = e["stats"][a]
            lines.append(
                f"| {e['turn']} | {a} | {s['draft_ms']['median']:,.0f} | {s['kept_tokens']['median']:,.0f} "
                f"| {s['main_cached_tokens']['median']:,.0f} | {s['prefilled_tokens']['median']:,.0f} "
                f"| {s['reused_spans']['median']:g} | {s['draft_cached_tokens']['median']:,.0f} |"
            )
    if summary:
        last = summary[-1]
        lines += [
            "",
            f"Memory held after turn {last['turn']}, median (min-max) over conversations, MiB (memo: KiB)",
            "",
            "| arm | main prefix cache MiB | selection memo KiB | draft prefix cache MiB |",
            "|---|---|---|---|",
        ]
        for a in arms:
            if a not in last["stats"]:
                continue
            m = last["stats"][a]["memory"]
            lines.append(
                f"| {a} | {m['main_cache']['median'] / 2**20:,.1f} ({m['main_cache']['min'] / 2**20:,.1f}-"
                f"{m['main_cache']['max'] / 2**20:,.1f}) | {m['memo']['median'] / 2**10:,.1f} | "
                f"{m['draft_cache']['median'] / 2**20:,.1f} ({m['draft_cache']['min'] / 2**20:,.1f}-"
                f"{m['draft_cache']['max'] / 2**20:,.1f}) |"
            )
    return "\n".join(lines)


# -- quality ----------------------------------------------------------------------------------------


def ask(engine: SpecPrefillEngine, history, conversation: dict, turn: int, answer_tokens: int) -> dict:
    result = engine.chat(history, documents=conversation["documents"], max_new_tokens=answer_tokens)
    text = result.text.strip()
    return {"answer": text, **scores(text, conversation["answers"][turn]), **stats_record(result)}


def quality_conversation(
    engines: dict[str, SpecPrefillEngine], arms: dict[str, dict], conversation: dict, number: int, answer_tokens: int
) -> dict:
    """One conversation on every arm, each with its own history; turn 1 runs once per keep rate (frozen)."""
    for engine in engines.values():
        clear(engine)
    histories = {name: opening(conversation) for name in engines}
    turns = []
    for turn, question in enumerate(conversation["questions"]):
        row: dict[str, Any] = {"turn": turn + 1, "question": question, "answers": conversation["answers"][turn]}
        for name in rotated(list(engines), number + turn):
            if turn:
                histories[name] = next_turn(histories[name], turns[-1][name]["answer"], question)
            if turn == 0 and name.startswith("reselect@"):
                continue
            row[name] = ask(engines[name], histories[name], conversation, turn, answer_tokens)
        if turn == 0:
            for name in engines:
                if name.startswith("reselect@"):
                    row[name] = {**row["frozen@" + name.split("@")[1]], "shared_with_frozen": True}
        turns.append(row)
        print(json.dumps({"turn": turn + 1} | {n: [row[n]["answer"], row[n]["contains"]] for n in engines}), flush=True)
    return {"conversation": number, "digest": sample_digest(conversation), "turns": turns}


def quality_summary(report: dict) -> dict:
    conversations = report["conversations"]
    keeps = [name.split("@")[1] for name in report["arms"] if name.startswith("frozen@")]
    out = {}
    for keep in keeps:
        frozen, reselect = f"frozen@{keep}", f"reselect@{keep}"
        turns = max((len(c["turns"]) for c in conversations), default=0)
        per_turn = []
        for t in range(turns):
            rows = [c["turns"][t] for c in conversations if len(c["turns"]) > t]
            f = [r[frozen]["contains"] for r in rows]
            s = [r[reselect]["contains"] for r in rows]
            d = [a - b for a, b in zip(f, s)]
            per_turn.append(
                {
                    "turn": t + 1,
                    "n": len(rows),
                    "frozen": sum(f) / len(f),
                    "reselect": sum(s) / len(s),
                    "difference": sum(d) / len(d),
                    "interval": bootstrap_interval(d),
                    "answers_differ": sum(r[frozen]["answer"] != r[reselect]["answer"] for r in rows),
                    "frozen_reused_spans": statistics.median(r[frozen]["reused_spans"] for r in rows),
                    "frozen_draft_ms": statistics.median(r[frozen]["draft_ms"] for r in rows),
                    "reselect_draft_ms": statistics.median(r[reselect]["draft_ms"] for r in rows),
                }
            )
        # Turns 2+: per conversation, the mean difference; the interval draws conversations.
        later = [[r[frozen]["contains"] - r[reselect]["contains"] for r in c["turns"][1:]] for c in conversations]
        later = [sum(d) / len(d) for d in later if d]
        pairs = [(r[frozen]["contains"], r[reselect]["contains"]) for c in conversations for r in c["turns"][1:]]
        out[keep] = {
            "per_turn": per_turn,
            "later_turns": {
                "n_conversations": len(later),
                "n_turns": len(pairs),
                "frozen": sum(a for a, _ in pairs) / len(pairs) if pairs else float("nan"),
                "reselect": sum(b for _, b in pairs) / len(pairs) if pairs else float("nan"),
                "difference": sum(a - b for a, b in pairs) / len(pairs) if pairs else float("nan"),
                "interval_by_conversation": bootstrap_interval(later),
                "frozen_only_correct": sum(a > b for a, b in pairs),
                "reselect_only_correct": sum(b > a for a, b in pairs),
            },
        }
    return out


def quality_markdown(report: dict) -> str:
    lines = [
        f"`contains` per turn, {len(report['conversations'])} conversations; frozen (stable selection, "
        "`reselect=False`) against `reselect=True` (the default); turn 1 is shared (same prompt, same selection)",
        "",
        "| keep | turn | n | frozen | reselected | frozen - reselected (95% CI) | answers differ "
        "| frozen reused spans | draft ms frozen / reselected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for keep, s in report["summary"].items():
        for t in s["per_turn"]:
            lo, hi = t["interval"]
            lines.append(
                f"| {keep} | {t['turn']} | {t['n']} | {t['frozen']:.2f} | {t['reselect']:.2f} | "
                f"{t['difference']:+.2f} ({lo:+.2f} to {hi:+.2f}) | {t['answers_differ']} | "
                f"{t['frozen_reused_spans']:g} | {t['frozen_draft_ms']:,.0f} / {t['reselect_draft_ms']:,.0f} |"
            )
    lines += [
        "",
        "Turns 2+ pooled; the interval draws conversations (their turns together)",
        "",
        "| keep | conversations | turns | frozen | reselected | frozen - reselected (95% CI) "
        "| only frozen right | only reselected right |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for keep, s in report["summary"].items():
        later = s["later_turns"]
        lo, hi = later["interval_by_conversation"]
        lines.append(
            f"| {keep} | {later['n_conversations']} | {later['n_turns']} | {later['frozen']:.2f} | "
            f"{later['reselect']:.2f} | {later['difference']:+.3f} ({lo:+.3f} to {hi:+.3f}) | "
            f"{later['frozen_only_correct']} | {later['reselect_only_correct']} |"
        )
    return "\n".join(lines)


# -- running ----------------------------------------------------------------------------------------


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "unknown"


def build_engines(
    arms: dict[str, dict], main_model, tokenizer, draft_model, look_ahead: int | None = None
) -> dict[str, SpecPrefillEngine]:
    extra = {} if look_ahead is None else {"look_ahead": look_ahead}
    return {
        name: SpecPrefillEngine.from_models(
            main_model, tokenizer, draft_model, min_prompt_tokens=0, **extra, **settings
        )
        for name, settings in arms.items()
    }


def load_pair(args):
    from specprefill_rag.models.loading import load_model

    main, draft = load_model(args.main, "cpu", args.dtype), load_model(args.draft, "cpu", args.dtype)
    return main.model, main.tokenizer, draft.model


def settings_of(args) -> dict:
    keys = [
        "study",
        "main",
        "draft",
        "dtype",
        "seed",
        "questions",
        "keep_rates",
        "answer_tokens",
        "documents",
        "document_tokens",
        "full_turns",
    ]
    return {k: getattr(args, k) for k in keys}


def write(report: dict, out: Path) -> None:
    summary, markdown = (
        (speed_summary, speed_markdown)
        if report["settings"]["study"] == "speed"
        else (quality_summary, quality_markdown)
    )
    report["summary"] = summary(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    Path(f"{out}.md").write_text(markdown(report) + "\n")


def run(args, models=None) -> dict:
    """Run the study of ``args``; ``models``: ``(main, tokenizer, draft)`` already loaded (tests)."""
    out = Path(args.out)
    earlier = None
    if args.resume and Path(f"{out}.json").is_file():
        earlier = json.loads(Path(f"{out}.json").read_text())
        if earlier["settings"] != settings_of(args):
            raise SystemExit(f"--resume: {out}.json was run with other settings: {earlier['settings']}")
    main_model, tokenizer, draft_model = models or load_pair(args)
    count_tokens = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    conversations = squad_conversations(
        args.conversations,
        args.questions,
        args.seed,
        n_documents=args.documents,
        document_tokens=args.document_tokens,
        count_tokens=count_tokens,
    )
    arms = speed_arms(args.keep_rates) if args.study == "speed" else quality_arms(args.keep_rates)
    engines = build_engines(arms, main_model, tokenizer, draft_model, getattr(args, "look_ahead", None))
    report = earlier or {
        "settings": settings_of(args),
        "machine": machine(),
        "arms": arms,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_before": uptime(),
        "conversations": [],
    }
    done = len(report["conversations"])
    for number, (saved, conversation) in enumerate(zip(report["conversations"], conversations)):
        if saved["digest"] != sample_digest(conversation):
            raise SystemExit(f"--resume: conversation {number} is not the one the earlier run evaluated")
    warm = squad_conversations(1, 2, args.seed + 1000, n_documents=3)[0]
    for engine in engines.values():  # first calls pay one-time costs (kernels, grammar tables)
        clear(engine)
        engine.chat(opening(warm), documents=warm["documents"], max_new_tokens=2)
    for number in range(done, len(conversations)):
        started = time.perf_counter()
        if args.study == "speed":
            full_turns = args.full_turns or [1, args.questions]
            record = speed_conversation(engines, conversations[number], number, args.answer_tokens, full_turns)
        else:
            record = quality_conversation(engines, arms, conversations[number], number, args.answer_tokens)
        record["seconds"] = time.perf_counter() - started
        record["load"] = uptime()
        report["conversations"].append(record)
        report["load_after"] = uptime()
        write(report, out)
        print(
            f"conversation {number + 1}/{len(conversations)}: {record['seconds']:.0f} s; {record['load']}", flush=True
        )
    if not report["conversations"]:
        write(report, out)
    return report


def machine() -> str:
    try:
        from ttft import machine as described

        return described()
    except Exception:  # noqa: BLE001 - only a description
        import platform

        return platform.processor() or platform.machine()


def parser() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("study", choices=["speed", "quality"])
    options.add_argument("--main", default=MAIN)
    options.add_argument("--draft", default=DRAFT)
    options.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    options.add_argument("--conversations", type=int, default=None, help="default: speed 5, quality 30")
    options.add_argument("--questions", type=int, default=None, help="turns per conversation (speed 4, quality 3)")
    options.add_argument("--keep-rates", type=float, nargs="+", default=None, help="speed: 0.1 0.3; quality: 0.3 0.1")
    options.add_argument(
        "--document-tokens",
        type=int,
        default=None,
        help="speed: documents of about this many tokens in turn 1 (default 4000)",
    )
    options.add_argument("--documents", type=int, default=None, help="quality: passages per conversation (default 5)")
    options.add_argument(
        "--full-turns",
        type=int,
        nargs="*",
        default=None,
        help="speed: turns at which the uncached full prefill runs (default: the first and last)",
    )
    options.add_argument("--answer-tokens", type=int, default=16, help="tokens of each answer (greedy)")
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--resume", action="store_true", help="keep the conversations <out>.json holds")
    options.add_argument("--report", action="store_true", help="rewrite <out>.md from <out>.json; run nothing")
    options.add_argument("--out", type=Path, required=True)
    return options


def defaults(args) -> argparse.Namespace:
    speed = args.study == "speed"
    args.conversations = args.conversations or (5 if speed else 30)
    args.questions = args.questions or (4 if speed else 3)
    args.keep_rates = args.keep_rates or ([0.1, 0.3] if speed else [0.3, 0.1])
    if speed:
        args.document_tokens = args.document_tokens or 4000
    else:
        args.documents = args.documents or 5
    return args


def main(argv: list[str] | None = None) -> None:
    args = defaults(parser().parse_args(argv))
    if args.report:
        write(json.loads(Path(f"{args.out}.json").read_text()), args.out)
        print(Path(f"{args.out}.md").read_text())
        return
    run(args)
    print(Path(f"{args.out}.md").read_text())


if __name__ == "__main__":
    main()
