"""TTFT over prompt lengths: full prefill vs SpecPrefill (two drafts) vs LongLLMLingua, one process.

For each length, every method runs once per repeat, interleaved, and the table gives medians with
min-max spread; the plot shows each method's speedup over full prefill next to the bound
``1 / (keep + draft_cost / main_cost)`` of the SmolLM2-135M draft. After the timed repeats, each
method runs once more under a memory probe: the peak growth of resident memory during the call
(sampled every millisecond), after ``malloc_trim`` has handed freed heap back to the system, so
memory freed by an earlier method is not counted as free for the next one. The models' own
weights are loaded before and are not part of it.

  full           the main model prefills the whole prompt to its first token
  specprefill    SmolLM2-135M draft scores (look-ahead 8), selection, sparse prefill at original positions
  self-<n>       draft='self': the main model's first n layers score (40% of them, the last 16 prompt
                 tokens as queries), then the same sparse prefill
  longllmlingua  ``llmlingua`` compresses the documents' text (SmolLM2-135M as its compressor), then the
                 main model prefills the compressed prompt

Main model: a random model of SmolLM2-1.7B's shape (timing does not depend on weights) or the real
SmolLM2-135M (``--main smollm2-135m``). The prompt is real text (Paul Graham essays) laid out as a
RAG prompt: instructions, documents of about 512 tokens, a question.

    python benchmarks/ttft_lengths.py --lengths 1024 2048 4096 8192 --repeats 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

import torch

from longllmlingua import LongLLMLingua
from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.config import DEFAULT_SELF_LAYER_SHARE, SpecPrefillConfig
from specprefill_rag.draft import LayerPrefixDraft, ModelDraft
from specprefill_rag.models import load_model, resolve
from specprefill_rag.selection import select_kept
from ttft import ESSAYS, ROOT, clock, first_token, machine, peak_rss_growth_mb, shape_model

QUESTION = "What does the author say about how startups should choose what to work on?"


def documents_of(tokenizer, length: int) -> list[str]:
    """Essay text cut into documents of 512 tokens, about ``length`` prompt tokens in all."""
    text = "\n\n".join(p.read_text() for p in sorted(ESSAYS.glob("*.txt")) if "LICENSE" not in p.name)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: length - 96]
    return [tokenizer.decode(ids[start : start + 512]) for start in range(0, len(ids), 512)]


def methods(engine: SpecPrefillEngine, compressor: LongLLMLingua, documents: list[str], args) -> dict:
    layout = engine.layout(QUESTION, documents)
    n_layers = args.self_layers or max(1, round(DEFAULT_SELF_LAYER_SHARE * engine.main.model.config.num_hidden_layers))
    drafts = {"specprefill": ModelDraft(engine.draft.model, look_ahead=8, pool_kernel=13),
              f"self-{n_layers}": LayerPrefixDraft(engine.main.model, n_layers, 13, SpecPrefillConfig().self_draft_window)}

    def sparse(draft) -> None:
        kept = select_kept(draft.score(layout.input_ids), layout.document_index, keep_rate=args.keep_rate, chunk_size=32)
        first_token(engine.backend, SparsePrompt.kept(layout.input_ids, kept))

    def longllmlingua() -> None:
        compressed = compressor.compress(documents, QUESTION, args.keep_rate)
        first_token(engine.backend, SparsePrompt.full(engine.layout(QUESTION, [compressed]).input_ids))

    runs = {"full": lambda: first_token(engine.backend, SparsePrompt.full(layout.input_ids)),
            "draft_scoring": lambda: drafts["specprefill"].score(layout.input_ids)}
    runs.update({name: (lambda d=draft: sparse(d)) for name, draft in drafts.items()})
    runs["longllmlingua"] = longllmlingua
    return {"prompt_tokens": len(layout), "document_tokens": layout.n_document_tokens, "runs": runs}


def peak_memory_mb(runs: dict) -> dict[str, float]:
    """Peak resident-memory growth (MB) of one call of each run, each after the heap is trimmed."""
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    peaks = {}
    for name, fn in runs.items():
        trim(0)
        peaks[name] = peak_rss_growth_mb(fn)
    return peaks


def run_length(engine, compressor, length: int, args) -> dict:
    study = methods(engine, compressor, documents_of(engine.tokenizer, length), args)
    samples: dict[str, list[float]] = {name: [] for name in study["runs"]}
    for _ in range(args.repeats):
        for name, fn in study["runs"].items():
            samples[name].append(clock(fn, "cpu"))
        print(length, {k: round(v[-1]) for k, v in samples.items()}, flush=True)
    median = {name: statistics.median(values) for name, values in samples.items()}
    memory = peak_memory_mb(study["runs"])
    bound = 1.0 / (args.keep_rate + median["draft_scoring"] / median["full"])
    return {
        "length": length, "prompt_tokens": study["prompt_tokens"], "document_tokens": study["document_tokens"],
        "timings_ms": {k: {"median": median[k], "min": min(v), "max": max(v), "n": len(v)} for k, v in samples.items()},
        "speedup": {k: median["full"] / median[k] for k in samples if k not in ("full", "draft_scoring")},
        "bound": bound,
        "peak_memory_mb": memory,
    }


def markdown(report: dict) -> str:
    names = [k for k in report["results"][0]["timings_ms"] if k != "draft_scoring"]
    lines = ["| prompt tokens | " + " | ".join(f"{n} ms (min-max)" for n in names) + " | bound | "
             + " | ".join(f"{n} speedup" for n in names if n != "full") + " |",
             "|---" * (2 * len(names) + 1) + "|"]
    memory_header = "| prompt tokens | " + " | ".join(f"{n} peak MB" for n in report["results"][0]["peak_memory_mb"]) + " |"
    memory_lines = ["", memory_header, "|---" * memory_header.count(" | ") + "|---|"]
    for row in report["results"]:
        cells = [f"{row['timings_ms'][n]['median']:,.0f} ({row['timings_ms'][n]['min']:,.0f}-{row['timings_ms'][n]['max']:,.0f})"
                 for n in names]
        speedups = [f"{row['speedup'][n]:.2f}x" for n in names if n != "full"]
        lines.append(f"| {row['prompt_tokens']:,} | " + " | ".join(cells) + f" | {row['bound']:.2f}x | " + " | ".join(speedups) + " |")
        memory_lines.append(f"| {row['prompt_tokens']:,} | " + " | ".join(f"{mb:,.0f}" for mb in row["peak_memory_mb"].values()) + " |")
    return "\n".join(lines + memory_lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    lengths = [r["prompt_tokens"] for r in rows]
    figure, axes = plt.subplots(figsize=(6, 4))
    for name in rows[0]["speedup"]:
        axes.plot(lengths, [r["speedup"][name] for r in rows], marker="o", label=name)
    axes.plot(lengths, [r["bound"] for r in rows], color="black", linestyle="--", label="bound (135M draft)")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("TTFT speedup over full prefill")
    axes.set_title(f"main {report['main']}, keep {report['keep_rate']}, {report['machine'][:40]}", fontsize=8)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    options.add_argument("--repeats", type=int, default=2)
    options.add_argument("--keep-rate", type=float, default=0.1)
    options.add_argument("--self-layers", type=int, help="default: what draft='self' takes (40% of the layers)")
    options.add_argument("--main", default="smollm2-1.7b-shape", choices=["smollm2-1.7b-shape", "smollm2-135m"])
    options.add_argument("--out", type=Path)
    args = options.parse_args()
    draft = load_model("smollm2-135m", "cpu")
    main_model = shape_model("smollm2-1.7b", torch.float32, "cpu") if args.main != "smollm2-135m" else draft.model
    engine = SpecPrefillEngine.from_models(main_model, draft.tokenizer, draft.model, min_prompt_tokens=0)
    compressor = LongLLMLingua(resolve("smollm2-135m"))
    report = {"machine": machine(), "main": args.main, "keep_rate": args.keep_rate, "repeats": args.repeats,
              "results": [run_length(engine, compressor, length, args) for length in args.lengths]}
    out = args.out or ROOT / "benchmarks" / "results" / f"ttft-lengths-{args.main}"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    Path(f"{out}.md").write_text(markdown(report) + "\n")
    plot(report, Path(f"{out}.png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
