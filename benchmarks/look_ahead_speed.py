"""What the draft's look-ahead costs, cold and warm, at 4k tokens on the real pair (issue #44).

The look-ahead decodes ``look_ahead - 1`` draft tokens after the prompt, each a pass that reads all of the
draft's weights: on a CPU the largest fixed cost of a warm draft, which no cache removes. Per request (a new
combination of SQuAD paragraphs, about ``--length`` document tokens) this runs, in an order rotated from request
to request, full prefill and, for each ``--look-aheads`` value N, a cold SpecPrefill request (``cold-la<N>``) and
a warm one with every document served from the per-document draft cache (``cached-la<N>``, blend), each arm
its own engine over the same models. ``--draft-layers N``: the same two arms for the draft run to its first N layers
(``draft_layers``; N its depth: the whole draft), which decodes no look-ahead and scores with the last prompt
tokens as queries (``cold-layers<N>``, ``cached-layers<N>``). Answers at each look-ahead: ``quality.py --methods
specprefill specprefill-la<N>`` (``specprefill-layers<N>`` for a depth).

    python benchmarks/look_ahead_speed.py --out benchmarks/results/document-cache-speed/look-ahead
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import: a model that is not installed fails, never downloads
sys.path.insert(0, str(Path(__file__).resolve().parent))

from document_cache_speed import (  # noqa: E402
    RATIO,
    SYSTEM,
    UNCACHED,
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
from specprefill_rag.models.loading import load_model  # noqa: E402


def variants(look_aheads: list[int], draft_layers: Sequence[int]) -> dict[str, dict[str, int]]:
    """Each variant's name (``la<N>``, ``layers<N>``) and the engine settings that make it."""
    return {f"la{n}": {"look_ahead": n} for n in look_aheads} | {
        f"layers{n}": {"draft_layers": n} for n in draft_layers
    }


def engines(
    main: Any, tokenizer: Any, draft: Any, keep: float, look_aheads: list[int], draft_layers: Sequence[int] = ()
) -> dict[str, SpecPrefillEngine]:
    """``full``, and per look-ahead N ``cold-la<N>`` and ``cached-la<N>`` (its own document store: stores are
    shared per device and size), then per depth N ``cold-layers<N>`` and ``cached-layers<N>``; the draft prefix
    cache off everywhere."""
    built = {"full": SpecPrefillEngine.from_models(main, tokenizer, draft, keep_rate=1.0, **UNCACHED)}
    for size, (name, setting) in enumerate(variants(look_aheads, draft_layers).items()):
        arm: dict[str, Any] = dict(UNCACHED, keep_rate=keep, **setting)
        built[f"cold-{name}"] = SpecPrefillEngine.from_models(main, tokenizer, draft, document_cache_mb=0, **arm)
        built[f"cached-{name}"] = SpecPrefillEngine.from_models(
            main, tokenizer, draft, document_cache_mb=4096 - size, draft_document_cache=True, **arm
        )
    return built


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--main", default="qwen2.5-coder-1.5b")
    options.add_argument("--draft", default="qwen2.5-coder-0.5b")
    options.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    options.add_argument("--length", type=int, default=4000, help="document tokens per prompt")
    options.add_argument("--keep", type=float, default=0.1)
    options.add_argument("--look-aheads", type=int, nargs="+", default=[8, 4])
    options.add_argument(
        "--draft-layers", type=int, nargs="*", default=[], help="depths to run the draft to, window queries"
    )
    options.add_argument("--requests", type=int, default=6)
    options.add_argument("--corpus", type=int, default=80, help="paragraphs warmed into each cached arm's store")
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--out", type=Path, required=True)
    options.add_argument("--resume", action="store_true")
    args = options.parse_args()
    names = ("main", "draft", "dtype", "length", "keep", "look_aheads", "requests", "corpus", "seed")
    settings = {k: getattr(args, k) for k in names} | ({"draft_layers": args.draft_layers} if args.draft_layers else {})
    report = load(args.out, settings, args.resume)
    report["machine"].append(machine())
    main_loaded, draft_loaded = load_model(args.main, "cpu", args.dtype), load_model(args.draft, "cpu", args.dtype)
    tokenizer = main_loaded.tokenizer
    count = token_counter(tokenizer)
    corpus = squad_paragraphs(args.seed)[: args.corpus]
    arms = engines(main_loaded.model, tokenizer, draft_loaded.model, args.keep, args.look_aheads, args.draft_layers)
    for name, engine in arms.items():
        if name.startswith("cached"):
            engine.warm_documents([p["text"] for p in corpus], SYSTEM)
    rng = random.Random(args.seed)
    for number in range(args.requests):
        documents, target = draw(corpus, args.length, count, rng)
        if number < len(report["records"]):
            continue
        order = rotated(list(arms), number)
        row: dict[str, Any] = {"request": number, "order": order, "documents": len(documents)}
        for name in order:
            row[name] = record(arms[name].generate(target["question"], documents, SYSTEM, max_new_tokens=1))
        report["records"].append(row)
        save(args.out, report, table(report))
        print(json.dumps({"request": number} | {name: round(row[name]["ttft_ms"]) for name in order}), flush=True)


def table(report: dict) -> str:
    settings, records = report["settings"], report["records"]
    longest = max(settings["look_aheads"])
    lines = table_head(
        "The draft's look-ahead, cold and warm (every document from the per-document draft cache, blend).",
        f"Settings: `{json.dumps(settings)}`",
        report,
        f"arm, n, TTFT ms, full / arm, draft ms, draft / cold draft at look-ahead {longest}, "
        f"TTFT / the same arm at look-ahead {longest}, documents cached",
    )
    for name in variants(settings["look_aheads"], settings.get("draft_layers", [])):
        for kind in ("cold", "cached"):
            arm, reference = f"{kind}-{name}", f"{kind}-la{longest}"
            lines.append(
                table_row(
                    [
                        arm,
                        str(len(records)),
                        spread([r[arm]["ttft_ms"] for r in records]),
                        spread([r["full"]["ttft_ms"] / r[arm]["ttft_ms"] for r in records], RATIO),
                        spread([r[arm]["draft_ms"] for r in records]),
                        spread([r[arm]["draft_ms"] / r[f"cold-la{longest}"]["draft_ms"] for r in records], RATIO),
                        spread([r[arm]["ttft_ms"] / r[reference]["ttft_ms"] for r in records], RATIO),
                        spread([r[arm]["draft_documents_cached"] / r["documents"] for r in records], RATIO),
                    ]
                )
            )
    lines.append("")
    lines.append(
        f"Cells: median (min-max) over requests; ratios per request (arms side by side). TTFT full: "
        f"{spread([r['full']['ttft_ms'] for r in records])} ms. Each arm its own engine; order rotated per request."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
