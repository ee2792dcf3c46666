"""`make demo`: one RAG question over the five articles in examples/documents/.

Answers it with a full prefill and with SpecPrefill, in one process, and prints each answer, the share
of document tokens kept and the time to first token (median of a few interleaved runs, with their
range). First on the embedded SmolLM2-135M-Instruct, which drafts with its own first layers (no draft
named: ``draft="self"``); then, once `make models` has installed it, on the Qwen2.5-Coder pair: the
1.5B main model with the 0.5B as its draft. Uses only the public API.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specprefill_rag import GenerationParams, ModelLoadError, SpecPrefillEngine

DOCUMENTS = Path(__file__).parent / "documents"
INSTRUCTIONS = "Answer the question using only the documents. Be brief."
QUESTION = "In what year was the Rosetta Stone found?"
EXPECTED = "1799"
PAIR = {"main": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b"}
# Every run cold: with the caches on, a repeat (and the full prefill after the warm-up, which shares its
# first document) would be served from the draft's or the main model's prefix cache, not prefilled.
COLD = {"draft_cache_mb": 0, "main_cache_mb": 0}


def ttft_table(engine: SpecPrefillEngine, documents: list[str], keep_rates: list[float | str], repeats: int) -> None:
    """Every keep rate ``repeats`` times, interleaved, then one row per keep rate. ``engine`` must run with both
    prefix caches off (:data:`COLD`), else its timings would be cache hits: ``ValueError`` otherwise.
    """
    if engine.config.draft_cache_mb or engine.config.main_cache_mb:
        raise ValueError("the demo times cold prefills: build the engine with draft_cache_mb=0 and main_cache_mb=0")
    layout = engine.layout(QUESTION, documents, INSTRUCTIONS)
    params = GenerationParams(max_new_tokens=32)
    print(f"Prompt: {len(layout)} tokens, {layout.n_document_tokens} of them in {len(documents)} documents")
    print(f"Question: {QUESTION}  (expected: {EXPECTED})\n")
    warm_up = engine.layout(QUESTION, documents[:1], INSTRUCTIONS)  # one-time costs out of the timings, cheaply
    engine.generate_layout(warm_up, GenerationParams(max_new_tokens=2), keep_rate=1.0)
    runs: dict[float | str, list] = {rate: [] for rate in keep_rates}
    for _ in range(repeats):
        for rate in keep_rates:
            runs[rate].append(engine.generate_layout(layout, params, keep_rate=rate))
    header = f"{'method':<26}{'kept docs':>10}{'TTFT ms (range)':>24}{'speed-up':>10}  answer"
    print(header + "\n" + "-" * len(header))
    full = statistics.median(r.stats.ttft_ms for r in runs[1.0])
    for rate, results in runs.items():
        ttfts = [r.stats.ttft_ms for r in results]
        median = statistics.median(ttfts)
        name = "full prefill" if rate == 1.0 else f"SpecPrefill keep {rate}"
        answer = results[-1].text.strip().replace("\n", " ")[:60]
        verdict = "ok " if EXPECTED in answer else "-- "
        spread = f"{median:,.0f} ({min(ttfts):,.0f}-{max(ttfts):,.0f})"
        print(f"{name:<26}{results[-1].stats.keep_rate:>9.0%} {spread:>23} {full / median:>8.2f}x  {verdict}{answer}")
    print(
        f"\nMedian of {repeats} run(s) each, interleaved; TTFT = draft + main prefill of the kept tokens. Every run "
        "here is cold\n(draft_cache_mb=0, main_cache_mb=0); with the default caches a second question over the same "
        "documents drafts only the question."
    )


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__)
    options.add_argument("--keep-rates", nargs="+", default=["0.3", "auto"], help="numbers in (0, 1] or 'auto'")
    options.add_argument("--repeats", type=int, default=3)
    options.add_argument(
        "--pair-repeats", type=int, default=1, help="runs per keep rate on the 1.5B pair (slow on CPU)"
    )
    args = options.parse_args()
    keep_rates: list[float | str] = [1.0] + [r if r == "auto" else float(r) for r in args.keep_rates]
    documents = [path.read_text() for path in sorted(DOCUMENTS.glob("*.txt"))]

    print("SmolLM2-135M-Instruct (embedded), drafting with its own first 12 of 30 layers ('self')")
    ttft_table(SpecPrefillEngine(**COLD), documents, keep_rates, args.repeats)
    try:
        pair = SpecPrefillEngine(**PAIR, **COLD)
    except ModelLoadError:
        print(
            "\nFor the Qwen2.5-Coder-1.5B main with its 0.5B sibling as the draft, run `make models` "
            "(about 1.6 GB, once)."
        )
        return
    print("\nQwen2.5-Coder-1.5B-Instruct (main) with Qwen2.5-Coder-0.5B-Instruct (draft), installed by `make models`")
    ttft_table(pair, documents, keep_rates, args.pair_repeats)


if __name__ == "__main__":
    main()
