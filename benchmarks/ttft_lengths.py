"""TTFT over prompt lengths: full prefill vs SpecPrefill (two drafts) vs LongLLMLingua and a sentence filter.

For each length, every method runs once per repeat, interleaved, and the table gives medians with
min-max spread; the plot shows each method's speedup over full prefill next to the bound
``1 / (kept share + draft_cost / main_cost)`` of the ``--draft`` model (its whole scoring: for a draft of
another vocabulary that includes rendering the prompt with its tokenizer and mapping the scores). The kept
share is what the main model prefills: the documents' tokens at ``--keep-rate`` plus the instructions,
question and template, always kept whole; the report also gives the bound at ``--keep-rate`` itself.
After the timed repeats, each method runs once more under a memory probe: the peak growth of
resident memory during the call (sampled every millisecond), after ``malloc_trim`` has handed freed
heap back to the system, so memory freed by an earlier method is not counted as free for the next
one. The models' own weights are loaded before and are not part of it.

  full           the main model prefills the whole prompt to its first token
  specprefill    the --draft model scores (look-ahead 8; the engine's direct or mapped path, as the report's
                 draft_path says), selection, sparse prefill at original positions
  specprefill-window  the same draft scoring with the prompt's last 16 tokens, nothing decoded
                 (``draft_queries="window"``), then the same sparse prefill
  self-<n>       draft='self': the main model's first n layers score (40% of them, the last 16 prompt
                 tokens as queries), then the same sparse prefill
  longllmlingua  ``llmlingua`` compresses the documents' text (the --draft model as its compressor, so both
                 compressors cost the same per token), then the main model prefills the compressed prompt
  embeddings-filter  the sentences most similar to the question (all-MiniLM-L6-v2) within the budget
                 (benchmarks/sentence_filter.py), then the main model prefills the shorter prompt
  embeddings-filter<NN>-specprefill  with --filter-share: the filter keeps that share of the documents, the
                 draft scores the shorter prompt, and the sparse prefill keeps --keep-rate of the original documents

Main model: a random model of SmolLM2-1.7B's shape with SmolLM2's tokenizer (timing does not depend
on weights), or any model spec (``--main smollm2-135m``, ``--main qwen2.5-coder-1.5b``, a folder). The
prompt is real text (Paul Graham essays) laid out as a RAG prompt with the main model's tokenizer:
instructions, documents of about 512 tokens, a question.

    python benchmarks/ttft_lengths.py --lengths 1024 2048 4096 8192 --repeats 2
    python benchmarks/ttft_lengths.py --main qwen2.5-coder-1.5b --draft smollm2-135m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

import torch
from longllmlingua import LongLLMLingua
from sentence_filter import SentenceFilter, sparse_keep_rate
from ttft import ESSAYS, ROOT, clock, first_token, machine, peak_rss_growth_mb, shape_model

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.config import DEFAULT_SELF_LAYER_SHARE
from specprefill_rag.draft.model import LayerPrefixDraft
from specprefill_rag.draft.paths import DirectScoring
from specprefill_rag.models.loading import load_model, load_tokenizer, resolve
from specprefill_rag.selection import select_kept

QUESTION = "What does the author say about how startups should choose what to work on?"


def documents_of(tokenizer, length: int) -> list[str]:
    """Essay text cut into documents of 512 tokens, about ``length`` prompt tokens in all."""
    text = "\n\n".join(p.read_text() for p in sorted(ESSAYS.glob("*.txt")) if "LICENSE" not in p.name)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: length - 96]
    return [tokenizer.decode(ids[start : start + 512]) for start in range(0, len(ids), 512)]


def methods(
    engine: SpecPrefillEngine,
    window: SpecPrefillEngine,
    compressor: LongLLMLingua | None,
    sentence_filter: SentenceFilter | None,
    documents: list[str],
    args,
) -> dict:
    layout = engine.layout(QUESTION, documents)
    n_layers = args.self_layers or max(1, round(DEFAULT_SELF_LAYER_SHARE * engine.main.model.config.num_hidden_layers))
    itself = LayerPrefixDraft(engine.main.model, n_layers, engine.config.pool_kernel, engine.config.self_draft_window)
    drafts = {
        "specprefill": engine.draft_scoring,
        "specprefill-window": window.draft_scoring,
        f"self-{n_layers}": DirectScoring(itself, None, 1, path="self"),
    }

    kept_tokens: dict[str, int] = {}

    def sparse(name: str, scoring) -> None:
        importance = scoring.importance(layout)
        kept = select_kept(importance, layout.document_index, keep_rate=args.keep_rate, chunk_size=32)
        kept_tokens[name] = kept.numel()
        first_token(engine.backend, SparsePrompt.kept(layout.input_ids, kept))

    def longllmlingua() -> None:
        compressed = compressor.compress(documents, QUESTION, args.keep_rate)
        first_token(engine.backend, SparsePrompt.full(engine.layout(QUESTION, [compressed]).input_ids))

    def embeddings_filter() -> None:
        kept = sentence_filter.filter(documents, QUESTION, args.keep_rate)
        first_token(engine.backend, SparsePrompt.full(engine.layout(QUESTION, kept).input_ids))

    def filtered_sparse() -> None:
        shorter = engine.layout(QUESTION, sentence_filter.filter(documents, QUESTION, args.filter_share))
        rate = sparse_keep_rate(args.keep_rate, layout.n_document_tokens, shorter.n_document_tokens)
        importance = drafts["specprefill"].importance(shorter)
        kept = select_kept(importance, shorter.document_index, keep_rate=rate, chunk_size=32)
        first_token(engine.backend, SparsePrompt.kept(shorter.input_ids, kept))

    runs = {
        "full": lambda: first_token(engine.backend, SparsePrompt.full(layout.input_ids)),
        "draft_scoring": lambda: drafts["specprefill"].importance(layout),
    }
    runs.update({name: (lambda n=name, d=draft: sparse(n, d)) for name, draft in drafts.items()})
    if compressor is not None:
        runs["longllmlingua"] = longllmlingua
    if sentence_filter is not None:
        runs["embeddings-filter"] = embeddings_filter
    if sentence_filter is not None and args.filter_share is not None:
        runs[f"embeddings-filter{round(100 * args.filter_share):02d}-specprefill"] = filtered_sparse
    return {
        "prompt_tokens": len(layout),
        "document_tokens": layout.n_document_tokens,
        "runs": runs,
        "kept_tokens": kept_tokens,
    }


def peak_memory_mb(runs: dict) -> dict[str, float]:
    """Peak resident-memory growth (MB) of one call of each run, each after the heap is trimmed."""
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    peaks = {}
    for name, fn in runs.items():
        trim(0)
        peaks[name] = peak_rss_growth_mb(fn)
    return peaks


def run_length(engine, window, compressor, sentence_filter, length: int, args, probe_memory: bool = True) -> dict:
    study = methods(engine, window, compressor, sentence_filter, documents_of(engine.tokenizer, length), args)
    samples: dict[str, list[float]] = {name: [] for name in study["runs"]}
    for _ in range(args.repeats):
        for name, fn in study["runs"].items():
            samples[name].append(clock(fn, "cpu"))
        print(length, {k: round(v[-1]) for k, v in samples.items()}, flush=True)
    median = {name: statistics.median(values) for name, values in samples.items()}
    memory = peak_memory_mb(study["runs"]) if probe_memory else {}
    # the bound with the share of the prompt the main model prefills (instructions, question and template are kept
    # whole, so it exceeds keep_rate), and with keep_rate itself: the paper's idealised 1 / (keep + draft/main)
    kept_share = study["kept_tokens"]["specprefill"] / study["prompt_tokens"]
    draft_share = median["draft_scoring"] / median["full"]
    return {
        "length": length,
        "prompt_tokens": study["prompt_tokens"],
        "document_tokens": study["document_tokens"],
        "kept_tokens": study["kept_tokens"],
        "kept_share": kept_share,
        "timings_ms": {k: {"median": median[k], "min": min(v), "max": max(v), "n": len(v)} for k, v in samples.items()},
        "speedup": {k: median["full"] / median[k] for k in samples if k not in ("full", "draft_scoring")},
        "bound": 1.0 / (kept_share + draft_share),
        "bound_at_keep_rate": 1.0 / (args.keep_rate + draft_share),
        "peak_memory_mb": memory,
    }


def markdown(report: dict) -> str:
    names = [k for k in report["results"][0]["timings_ms"] if k != "draft_scoring"]
    lines = [
        "| prompt tokens | "
        + " | ".join(f"{n} ms (min-max)" for n in names)
        + " | kept share | bound | "
        + " | ".join(f"{n} speedup" for n in names if n != "full")
        + " |",
        "|---" * (2 * len(names) + 2) + "|",
    ]
    memory_header = (
        "| prompt tokens | " + " | ".join(f"{n} peak MB" for n in report["results"][0]["peak_memory_mb"]) + " |"
    )
    memory_lines = ["", memory_header, "|---" * memory_header.count(" | ") + "|---|"]
    for row in report["results"]:
        cells = [
            f"{row['timings_ms'][n]['median']:,.0f} "
            f"({row['timings_ms'][n]['min']:,.0f}-{row['timings_ms'][n]['max']:,.0f})"
            for n in names
        ]
        speedups = [f"{row['speedup'][n]:.2f}x" for n in names if n != "full"]
        bound = f" | {row['kept_share']:.3f} | {row['bound']:.2f}x | "
        lines.append(f"| {row['prompt_tokens']:,} | " + " | ".join(cells) + bound + " | ".join(speedups) + " |")
        memory_lines.append(
            f"| {row['prompt_tokens']:,} | " + " | ".join(f"{mb:,.0f}" for mb in row["peak_memory_mb"].values()) + " |"
        )
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
    bound = f"bound ({report['draft']} draft)"
    axes.plot(lengths, [r["bound"] for r in rows], color="black", linestyle="--", label=bound)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("TTFT speedup over full prefill")
    title = f"main {report['main']}, draft {report['draft']} ({report['draft_path']}), keep {report['keep_rate']}"
    axes.set_title(f"{title}, {report['machine'][:40]}", fontsize=8)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


SHAPE_MAIN = "smollm2-1.7b-shape"


def load_engines(args) -> tuple[SpecPrefillEngine, SpecPrefillEngine]:
    """The main model (a spec, or the random SmolLM2-1.7B shape with SmolLM2's tokenizer) and the draft, as two
    engines over the same models: the draft scoring with its look-ahead (`specprefill`, the paper's 8, as in every
    recorded run) and with the prompt's last 16 tokens (`specprefill-window`, `draft_queries="window"`); each picks
    the direct or mapped path by vocabulary."""
    draft = load_model(args.draft, "cpu", args.dtype)
    if args.main == SHAPE_MAIN:
        main_model, main_tokenizer = shape_model("smollm2-1.7b", torch.float32, "cpu"), load_tokenizer("smollm2-135m")
    elif args.main == args.draft:
        main_model, main_tokenizer = draft.model, draft.tokenizer
    else:
        main = load_model(args.main, "cpu", args.dtype)
        main_model, main_tokenizer = main.model, main.tokenizer
    # draft_cache_mb=0, main_cache_mb=0: every repeat times a cold draft and a cold main prefill (the prefix caches
    # would serve repeats 2+ from repeat 1's KV)
    common = {"draft_tokenizer": draft.tokenizer, "min_prompt_tokens": 0, "draft_cache_mb": 0, "main_cache_mb": 0}
    return tuple(  # type: ignore[return-value]
        SpecPrefillEngine.from_models(main_model, main_tokenizer, draft.model, draft_queries=queries, **common)
        for queries in ("look_ahead", "window")
    )


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    options.add_argument("--repeats", type=int, default=2)
    options.add_argument("--keep-rate", type=float, default=0.1)
    options.add_argument("--self-layers", type=int, help="default: what draft='self' takes (40%% of the layers)")
    options.add_argument("--main", default=SHAPE_MAIN, help=f"{SHAPE_MAIN} (random weights) or a model spec")
    options.add_argument("--draft", default="smollm2-135m", help="model spec; another vocabulary: the mapped path")
    options.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="of loaded models")
    options.add_argument("--no-longllmlingua", action="store_true", help="leave the LongLLMLingua baseline out")
    options.add_argument("--no-embeddings-filter", action="store_true", help="leave the sentence filter out")
    options.add_argument(
        "--filter-share",
        type=float,
        help="also time the sentence filter keeping this share of the documents, then specprefill on the rest",
    )
    options.add_argument("--out", type=Path)
    args = options.parse_args()
    if args.filter_share is not None and not (args.keep_rate < args.filter_share < 1):
        options.error("--filter-share must lie between --keep-rate and 1")
    engine, window = load_engines(args)
    dtype = engine.draft.model.dtype  # LongLLMLingua's compressor in the draft's dtype: the same cost per token
    compressor = None if args.no_longllmlingua else LongLLMLingua(resolve(args.draft, dtype), dtype)
    sentence_filter = None if args.no_embeddings_filter else SentenceFilter(engine.tokenizer)
    report = {
        "machine": machine(),
        "main": args.main,
        "draft": args.draft,
        "draft_path": engine.draft_path,
        "dtype": args.dtype,
        "keep_rate": args.keep_rate,
        "repeats": args.repeats,
        "results": [],
    }
    suffix = "" if args.draft == "smollm2-135m" else f"-draft-{Path(args.draft).name}"
    out = args.out or ROOT / "benchmarks" / "results" / "ttft-lengths" / f"{Path(args.main).name}{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    for length in args.lengths:  # written after each length: a run cut short keeps what it measured
        report["results"].append(run_length(engine, window, compressor, sentence_filter, length, args))
        Path(f"{out}.json").write_text(json.dumps(report, indent=1))
        Path(f"{out}.md").write_text(markdown(report) + "\n")
    plot(report, Path(f"{out}.png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
