"""A warm window draft: its query window scored in the assembly's fresh forward, against a second pass (issue #44).

A draft that scores with the prompt's last ``W`` tokens (``draft_queries="window"``, ``draft_layers``, ``self``)
and takes its documents from the per-document cache used to assemble the KV of the first ``L - W`` tokens, then
run the window in a pass of its own over it. ``LayerPrefixDraft`` now has the assembly's fresh forward run the
window after the tokens the store lacks and scores it there (``assemble_prompt_kv(observe=...)``). The reference
arm here is the two-pass form it replaced, built from the same public pieces. Both arms, and a cold draft with
the look-ahead and one with the window (the denominators of "warm / cold"), run on the same prompt with every
document held, in one process, in rotated order, ``--repeats`` times per repair; the token ids are random (the
cost does not depend on them): a prefix, ``--documents`` documents of ``--document-tokens`` each with a label
token between them, and a question.

    python benchmarks/window_fold.py --out benchmarks/results/document-cache-speed/window-fold
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import: a model that is not installed fails, never downloads
sys.path.insert(0, str(Path(__file__).resolve().parent))

from document_cache_speed import machine, repair_of, rotated, save, spread  # noqa: E402

from specprefill_rag.draft.assembly import DocumentSpans, assemble_prompt_kv  # noqa: E402
from specprefill_rag.draft.document_cache import DocumentKVCache  # noqa: E402
from specprefill_rag.draft.hooks import StopForward, capture_attention, stop_after_layers  # noqa: E402
from specprefill_rag.draft.importance import ImportanceAccumulator  # noqa: E402
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft  # noqa: E402
from specprefill_rag.kvcache.prefix_cache import DraftIdentity  # noqa: E402
from specprefill_rag.models.loading import load_model  # noqa: E402

WINDOW = 16
PREFIX, QUESTION = 120, 40
ARMS = ["cold-look-ahead", "cold-window", "folded", "two-passes"]


@torch.inference_mode()
def two_passes(draft: LayerPrefixDraft, ids: torch.Tensor, spans: DocumentSpans) -> torch.Tensor:
    """The replaced form: assemble the KV of the first ``L - W`` tokens, then score the window in a pass of its own."""
    model, window = draft.model, draft.query_window
    until = ids.numel() - window
    identity = DraftIdentity.of(model, draft.n_layers)
    assert draft.document_cache is not None
    assembled = assemble_prompt_kv(model, identity, ids, spans, draft.document_cache, draft.repair, until)
    accumulator = ImportanceAccumulator(ids.numel(), window, ids.device)
    positions = torch.arange(until, ids.numel())
    inputs = {"input_ids": ids[until:].view(1, -1), "position_ids": positions.view(1, -1), "cache_position": positions}
    with capture_attention(model, accumulator, draft.pool_kernel, window), stop_after_layers(model, draft.n_layers):
        try:
            model(**inputs, past_key_values=assembled.past, use_cache=True, logits_to_keep=1)
        except StopForward:
            pass
    return accumulator.result()


def prompt(vocabulary: int, documents: int, document_tokens: int, seed: int) -> tuple[torch.Tensor, DocumentSpans]:
    """Random ``[L]`` ids: a prefix, the documents with one label token before each, a question; and their spans."""
    generator = torch.Generator().manual_seed(seed)
    length = PREFIX + documents * (document_tokens + 1) + QUESTION
    ids = torch.randint(0, vocabulary, (length,), generator=generator)
    starts = [PREFIX + 1 + i * (document_tokens + 1) for i in range(documents)]
    spans = torch.tensor([[start, start + document_tokens] for start in starts])
    return ids, DocumentSpans(spans, PREFIX)


def timed(score: Any) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    importance = score()
    return time.perf_counter() - started, importance


def run_repair(model: Any, repair: str, ids: torch.Tensor, spans: DocumentSpans, repeats: int) -> dict:
    layers = model.config.num_hidden_layers
    store = DocumentKVCache(2**33)
    cached = LayerPrefixDraft(model, layers, 13, WINDOW, document_cache=store, repair=repair_of(repair))
    cached.warm(ids, spans)
    scorers = {
        "cold-look-ahead": lambda: ModelDraft(model, 8, 13, frozenset()).score(ids),
        "cold-window": lambda: LayerPrefixDraft(model, layers, 13, WINDOW).score(ids),
        "folded": lambda: cached.score_prompt(ids, spans).importance,
        "two-passes": lambda: two_passes(cached, ids, spans),
    }
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    scores = {}
    for number in range(repeats):
        for arm in rotated(ARMS, number):
            spent, scores[arm] = timed(scorers[arm])
            seconds[arm].append(spent)
    difference = float((scores["folded"] - scores["two-passes"]).abs().max() / scores["two-passes"].abs().max())
    return {
        "repair": repair,
        "prompt_tokens": ids.numel(),
        "seconds": seconds,
        "folded_over_two_passes": [f / t for f, t in zip(seconds["folded"], seconds["two-passes"])],
        "folded_over_cold_look_ahead": [f / c for f, c in zip(seconds["folded"], seconds["cold-look-ahead"])],
        "two_passes_over_cold_look_ahead": [t / c for t, c in zip(seconds["two-passes"], seconds["cold-look-ahead"])],
        "largest_relative_score_difference": difference,
    }


def table(report: dict) -> str:
    lines = [
        f"Settings: `{json.dumps(report['settings'])}`",
        f"Machine: `{json.dumps(report['machine'])}`",
        "",
        "| repair | prompt tokens | cold, look-ahead 8 s | cold, window s | warm, two passes s | warm, folded s "
        "| folded / two passes | two passes / cold look-ahead | folded / cold look-ahead | score difference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["records"]:
        s = r["seconds"]
        cells = [spread(s[arm], "{:.2f}") for arm in ("cold-look-ahead", "cold-window", "two-passes", "folded")]
        ratios = [
            spread(r[name], "{:.3f}")
            for name in ("folded_over_two_passes", "two_passes_over_cold_look_ahead", "folded_over_cold_look_ahead")
        ]
        lines.append(
            f"| {r['repair']} | {r['prompt_tokens']:,} | {' | '.join(cells)} | {' | '.join(ratios)} "
            f"| {r['largest_relative_score_difference']:.1e} |"
        )
    lines += [
        "",
        "Cells: median (min-max) over repeats; ratios per repeat (the arms rotate). Every document is held (a warm "
        "request). Score difference: the largest difference between the two warm arms' importance, relative to "
        "its largest value (rounding in the model's dtype).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--repairs", nargs="+", default=["naive", "blend"])
    parser.add_argument("--documents", type=int, default=10)
    parser.add_argument("--document-tokens", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.draft, "cpu", args.dtype).model
    ids, spans = prompt(model.config.vocab_size, args.documents, args.document_tokens, args.seed)
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "threads")}
    report = {"settings": settings | {"window": WINDOW}, "machine": [machine()], "records": []}
    for repair in args.repairs:
        report["records"].append(run_repair(model, repair, ids, spans, args.repeats))
        save(args.out, report, table(report))
        print(json.dumps(report["records"][-1]["folded_over_two_passes"]), flush=True)


if __name__ == "__main__":
    main()
