"""First sight in context against a cold draft, arms in rotated order, each on a new engine or a used one (#44).

The `draft` study of ``document_cache_speed.py`` runs its arms in one order (the cold draft first, on one
engine it reuses) and builds each first-sight arm a new engine and store just before it runs. At 4k tokens it
put first sight in context at 1.09 of a cold draft. This study asks how much of that is the order and the new
engine: per request it runs, in an order rotated from request to request,

* ``cold``: the cold draft on the one engine every request reuses;
* ``cold-new``: the cold draft on an engine built for this request;
* ``in_context-new``: first sight in context on a new engine with an empty store (the ``draft`` study's arm);
* ``in_context-used``: the same after the new engine answered an unrelated prompt under another system prompt
  (so the timed prompt still misses its prefix and every document: the same joint pass).

The draft model is the main model too (as in the ``draft`` study); the draft's time is what is compared.

    python benchmarks/first_sight_order.py --out benchmarks/results/document-cache-speed/first-sight-order
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import: a model that is not installed fails, never downloads
sys.path.insert(0, str(Path(__file__).resolve().parent))

from document_cache_speed import (  # noqa: E402
    RATIO,
    SYSTEM,
    UNCACHED,
    draft_of,
    draw,
    load,
    machine,
    record,
    rotated,
    save,
    spread,
    squad_paragraphs,
    table_head,
    table_row,
    token_counter,
)

from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.draft.repair import DEFAULT_REPAIR  # noqa: E402
from specprefill_rag.models.loading import load_model  # noqa: E402

ARMS = ("cold", "cold-new", "in_context-new", "in_context-used")


def arms(model: Any, tokenizer: Any, cold: SpecPrefillEngine, settings: dict, number: int) -> dict[str, Callable]:
    """Each arm of request ``number``: a function of (documents, question) to its record."""
    common = dict(UNCACHED, keep_rate=settings["keep"], **draft_of(None))

    def run(engine: SpecPrefillEngine, documents: list[str], question: str) -> dict:
        return record(engine.generate(question, documents, SYSTEM, max_new_tokens=1))

    def cold_new(documents: list[str], question: str) -> dict:
        return run(
            SpecPrefillEngine.from_models(model, tokenizer, model, document_cache_mb=0, **common), documents, question
        )

    def in_context(used: bool) -> Callable[[list[str], str], dict]:
        def arm(documents: list[str], question: str) -> dict:
            engine = SpecPrefillEngine.from_models(  # a new, empty store: stores are shared per size
                model, tokenizer, model, document_cache_mb=4000 - 2 * number - used, draft_document_cache=True, **common
            )
            engine.draft.repair = replace(DEFAULT_REPAIR, first_sight="in_context")  # type: ignore[attr-defined]
            if used:
                engine.generate("Who wrote it?", documents[-1:], "Reply in one word.", max_new_tokens=1)
            return run(engine, documents, question)

        return arm

    return {
        "cold": lambda documents, question: run(cold, documents, question),
        "cold-new": cold_new,
        "in_context-new": in_context(False),
        "in_context-used": in_context(True),
    }


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--draft", default="qwen2.5-coder-0.5b")
    options.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    options.add_argument("--length", type=int, default=4000, help="document tokens per prompt")
    options.add_argument("--keep", type=float, default=0.1)
    options.add_argument("--requests", type=int, default=8)
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--out", type=Path, required=True)
    options.add_argument("--resume", action="store_true")
    args = options.parse_args()
    settings = {k: getattr(args, k) for k in ("draft", "dtype", "length", "keep", "requests", "seed")}
    report = load(args.out, settings, args.resume)
    report["machine"].append(machine())
    loaded = load_model(args.draft, "cpu", args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    count = token_counter(tokenizer)
    corpus = squad_paragraphs(args.seed)[:200]
    cold = SpecPrefillEngine.from_models(
        model, tokenizer, model, document_cache_mb=0, keep_rate=args.keep, **draft_of(None), **UNCACHED
    )
    rng = random.Random(args.seed)
    for number in range(args.requests):
        documents, target = draw(corpus, args.length, count, rng)
        if number < len(report["records"]):
            continue
        order = rotated(list(ARMS), number)
        functions = arms(model, tokenizer, cold, settings, number)
        row: dict[str, Any] = {"request": number, "order": order}
        for name in order:
            row[name] = functions[name](documents, target["question"])
        report["records"].append(row)
        save(args.out, report, table(report))
        print(json.dumps({"request": number} | {name: round(row[name]["draft_ms"]) for name in order}), flush=True)


def table(report: dict) -> str:
    records = report["records"]
    lines = table_head(
        "First sight in context against a cold draft: arms in an order rotated per request, on new or used engines.",
        f"Settings: `{json.dumps(report['settings'])}`",
        report,
        "arm, n, prompt tokens, draft ms, / cold draft, / cold draft on a new engine",
    )
    for arm in ARMS:
        lines.append(
            table_row(
                [
                    arm,
                    str(len(records)),
                    spread([r[arm]["prompt_tokens"] for r in records]),
                    spread([r[arm]["draft_ms"] for r in records]),
                    spread([r[arm]["draft_ms"] / r["cold"]["draft_ms"] for r in records], RATIO),
                    spread([r[arm]["draft_ms"] / r["cold-new"]["draft_ms"] for r in records], RATIO),
                ]
            )
        )
    lines.append("")
    lines.append(
        "Cells: median (min-max) over requests; ratios per request. `cold`: one engine reused by every request; "
        "the other arms build their engine for the request; `in_context-used` answered an unrelated prompt under "
        "another system prompt first."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
