"""Answer-quality study: SpecPrefill and baselines at several keep rates, same main model.

Tasks, built from ../shared/data (read in place, never copied):
  squad   a SQuAD v1.1 question's paragraph among distractor paragraphs of other articles, gold at a
          random depth; scored by normalised containment, EM and F1 against the gold answers
  niah    a needle sentence (several kinds) at depths 0-100% of Paul Graham essays split into
          documents; scored by containment of the needle's answer

Methods (all share one prompt layout and one main model):
  specprefill      draft = the main model's sibling (here: the same SmolLM2-135M), look-ahead 8
  specprefill-la1  the same draft, look-ahead 1
  self-<n>         the main model's first n layers as draft
  contiguous       specprefill's kept tokens, renumbered 0..K-1 (what original positions are worth)
  random           random chunks at the same budget (seeded)
  first            the first tokens of every document at the same budget
LongLLMLingua is not in this script yet (see BENCHMARKS.md).

    python benchmarks/quality.py --task squad --samples 40 --keep-rates 0.1 0.3 1.0
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import string
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.config import GenerationParams
from specprefill_rag.detokenize import IncrementalText
from specprefill_rag.draft import LayerPrefixDraft, ModelDraft
from specprefill_rag.selection import select_kept

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
INSTRUCTIONS = "Answer the question using the documents. Answer with a short phrase."
NEEDLES = [
    ("The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
     "What is the best thing to do in San Francisco?", ["sandwich", "dolores park"]),
    ("The secret ingredient of Grandma Rosa's soup is smoked paprika.",
     "What is the secret ingredient of Grandma Rosa's soup?", ["paprika"]),
    ("The access code for the Halvorsen vault is 4417.", "What is the access code for the Halvorsen vault?", ["4417"]),
    ("The capital of the fictional island of Veltra is Marisport.", "What is the capital of the island of Veltra?",
     ["marisport"]),
    ("Doctor Amina Osei keeps her spare keys inside a blue teapot.", "Where does Doctor Amina Osei keep her spare keys?",
     ["teapot"]),
]


# -- scoring (standard SQuAD normalisation) ---------------------------------------------------------

def normalise(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, gold: str) -> float:
    predicted, expected = normalise(prediction).split(), normalise(gold).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def scores(prediction: str, answers: list[str]) -> dict[str, float]:
    return {
        "contains": float(any(normalise(a) in normalise(prediction) for a in answers)),
        "em": float(any(normalise(a) == normalise(prediction) for a in answers)),
        "f1": max(f1(prediction, a) for a in answers),
    }


# -- tasks ------------------------------------------------------------------------------------------

def squad_samples(count: int, n_documents: int, seed: int) -> list[dict]:
    articles = json.loads((DATA / "squad" / "dev-v1.1.reconstructed.json").read_text())["data"]
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        article = rng.randrange(len(articles))
        paragraph = rng.choice(articles[article]["paragraphs"])
        qa = rng.choice(paragraph["qas"])
        others = [a for i, a in enumerate(articles) if i != article]
        distractors = [rng.choice(rng.choice(others)["paragraphs"])["context"] for _ in range(n_documents - 1)]
        depth = rng.randrange(n_documents)
        documents = distractors[:depth] + [paragraph["context"]] + distractors[depth:]
        samples.append({"question": qa["question"], "documents": documents, "answers": [a["text"] for a in qa["answers"]],
                        "gold_document": depth})
    return samples


def niah_samples(count: int, tokenizer, length: int, seed: int) -> list[dict]:
    essays = sorted(p for p in (DATA / "niah_paul_graham").glob("*.txt") if "LICENSE" not in p.name)
    ids = tokenizer("\n\n".join(p.read_text() for p in essays), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    samples, n_documents = [], 5
    for index in range(count):
        needle, question, answers = NEEDLES[index % len(NEEDLES)]
        start = rng.randrange(len(ids) - length)
        per_document = length // n_documents
        documents = [tokenizer.decode(ids[start + i * per_document : start + (i + 1) * per_document]) for i in range(n_documents)]
        depth = (index * 7) % 11 / 10  # 0%, 10%, ... 100% of the haystack, spread over the samples
        target = min(int(depth * n_documents), n_documents - 1)
        sentences = documents[target].split(". ")
        cut = int(len(sentences) * (depth * n_documents - target))
        documents[target] = ". ".join(sentences[:cut] + [needle.rstrip(".")] + sentences[cut:])
        samples.append({"question": question, "documents": documents, "answers": answers, "gold_document": target,
                        "depth": depth})
    return samples


# -- methods: each maps (layout, keep_rate) -> (kept indices, position ids) -------------------------

def first_tokens(document_index: torch.Tensor, keep_rate: float) -> torch.Tensor:
    """Keep every non-document token and the first ceil(keep_rate * n_d) tokens of each document d."""
    keep = document_index < 0
    for document in document_index[document_index >= 0].unique().tolist():
        positions = torch.nonzero(document_index == document).flatten()
        keep[positions[: math.ceil(keep_rate * positions.numel())]] = True
    keep[-1] = True
    return torch.nonzero(keep).flatten()


def make_methods(engine: SpecPrefillEngine, self_layers: list[int], seed: int) -> dict[str, Callable]:
    model = engine.main.model
    drafts = {
        "specprefill": ModelDraft(engine.draft.model, look_ahead=8, pool_kernel=13, eos_token_ids=engine.backend.eos_ids),
        "specprefill-la1": ModelDraft(engine.draft.model, look_ahead=1, pool_kernel=13),
        **{f"self-{n}": LayerPrefixDraft(model, n, 13) for n in self_layers},
    }
    cache: dict[str, torch.Tensor] = {}  # one prompt's scores: build the methods anew for each prompt

    def draft_method(name: str, renumber: bool = False) -> Callable:
        def run(layout, keep_rate: float):
            if name not in cache:
                cache[name] = drafts[name].score(layout.input_ids)
            kept = select_kept(cache[name], layout.document_index, keep_rate=keep_rate, chunk_size=32)
            return kept, (torch.arange(kept.numel()) if renumber else kept)
        return run

    def random_chunks(layout, keep_rate: float):
        generator = torch.Generator().manual_seed(seed + len(layout))
        kept = select_kept(torch.rand(len(layout), generator=generator), layout.document_index, keep_rate=keep_rate,
                           chunk_size=32)
        return kept, kept

    def first(layout, keep_rate: float):
        kept = first_tokens(layout.document_index, keep_rate)
        return kept, kept

    methods = {name: draft_method(name) for name in drafts}
    methods.update({"contiguous": draft_method("specprefill", renumber=True), "random": random_chunks, "first": first})
    return methods


def answer(engine: SpecPrefillEngine, layout, kept: torch.Tensor, positions: torch.Tensor, max_new_tokens: int) -> str:
    prompt_length = len(layout) if torch.equal(positions, kept) else int(kept.numel())
    prompt = SparsePrompt(layout.input_ids[kept], positions, prompt_length)
    text = IncrementalText(engine.tokenizer, ("\n",))
    for token in engine.backend.generate(prompt, GenerationParams(max_new_tokens=max_new_tokens)):
        text.push(token)
        if text.stopped:
            break
    text.finish()
    return text.emitted.strip()


# -- study ------------------------------------------------------------------------------------------

def bootstrap_interval(values: list[float], seed: int = 0, rounds: int = 2000) -> tuple[float, float]:
    if not values:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds)]


def run(args: argparse.Namespace) -> dict:
    engine = SpecPrefillEngine(min_prompt_tokens=0)
    if args.task == "squad":
        samples = squad_samples(args.samples, args.documents, args.seed)
    else:
        samples = niah_samples(args.samples, engine.tokenizer, args.length, args.seed)
    records = []
    started = time.perf_counter()
    for index, sample in enumerate(samples):
        layout = engine.layout(sample["question"], sample["documents"], INSTRUCTIONS)
        methods = make_methods(engine, args.self_layers, args.seed)
        full = answer(engine, layout, torch.arange(len(layout)), torch.arange(len(layout)), args.max_new_tokens)
        records.append({"sample": index, "method": "full", "keep_rate": 1.0, "answer": full, **scores(full, sample["answers"])})
        for name, method in methods.items():
            for keep_rate in args.keep_rates:
                kept, positions = method(layout, keep_rate)
                text = answer(engine, layout, kept, positions, args.max_new_tokens)
                kept_gold = float((layout.document_index[kept] == sample["gold_document"]).any())
                records.append({"sample": index, "method": name, "keep_rate": keep_rate, "answer": text,
                                "gold_document_kept": kept_gold, **scores(text, sample["answers"])})
        elapsed = time.perf_counter() - started
        print(f"[{index + 1}/{len(samples)}] {elapsed:.0f}s, prompt {len(layout)} tokens", flush=True)
    return {"task": args.task, "samples": len(samples), "records": records, "settings": vars(args) | {"out": None}}


def summarise(report: dict, metric: str) -> list[dict]:
    records = report["records"]
    full = {r["sample"]: r[metric] for r in records if r["method"] == "full"}
    full_mean = sum(full.values()) / len(full)
    rows = [{"method": "full", "keep_rate": 1.0, "score": full_mean, "ci": bootstrap_interval(list(full.values())),
             "retention": 1.0}]
    for method in dict.fromkeys(r["method"] for r in records if r["method"] != "full"):
        for keep_rate in sorted({r["keep_rate"] for r in records if r["method"] == method}):
            chosen = [r for r in records if r["method"] == method and r["keep_rate"] == keep_rate]
            values = [r[metric] for r in chosen]
            mean = sum(values) / len(values)
            gold_kept = sum(r["gold_document_kept"] for r in chosen) / len(chosen)
            rows.append({"method": method, "keep_rate": keep_rate, "score": mean, "ci": bootstrap_interval(values),
                         "retention": mean / full_mean if full_mean else float("nan"), "gold_kept": gold_kept})
    return rows


def markdown(report: dict, metric: str) -> str:
    lines = [f"| method | keep | {metric} | 95% CI | retention | gold document kept |", "|---|---|---|---|---|---|"]
    for row in summarise(report, metric):
        low, high = row["ci"]
        gold = f"{row['gold_kept']:.0%}" if "gold_kept" in row else "100%"
        lines.append(f"| {row['method']} | {row['keep_rate']:g} | {row['score']:.3f} | {low:.2f}-{high:.2f} | "
                     f"{row['retention']:.0%} | {gold} |")
    return "\n".join(lines)


def plot(report: dict, metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in summarise(report, metric) if r["method"] != "full"]
    figure, axes = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = [(r["keep_rate"], r["score"]) for r in rows if r["method"] == method]
        axes.plot(*zip(*points), marker="o", label=method)
    full = summarise(report, metric)[0]["score"]
    axes.axhline(full, color="black", linestyle="--", label="full prefill")
    axes.set_xlabel("keep rate (share of document tokens)")
    axes.set_ylabel(metric)
    axes.set_title(f"{report['task']}: {report['samples']} samples, SmolLM2-135M")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--task", choices=["squad", "niah"], default="squad")
    options.add_argument("--samples", type=int, default=40)
    options.add_argument("--documents", type=int, default=10, help="squad: paragraphs per prompt")
    options.add_argument("--length", type=int, default=2000, help="niah: haystack tokens")
    options.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    options.add_argument("--self-layers", type=int, nargs="*", default=[8])
    options.add_argument("--max-new-tokens", type=int, default=24)
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--out", type=Path)
    args = options.parse_args()
    report = run(args)
    out = args.out or ROOT / "benchmarks" / "results" / f"quality-{args.task}"
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    table = markdown(report, "contains")
    Path(f"{out}.md").write_text(table + "\n")
    plot(report, "contains", Path(f"{out}.png"))
    print(table)


if __name__ == "__main__":
    main()
