"""Per-document draft KV (issue #28) against joint draft scoring: what it keeps, and what it costs.

Per sample, the draft scores the prompt jointly (the paper's draft: one pass over the whole prompt) and
from the per-document cache, warmed beforehand with each document encoded alone after the prompt's prefix
(so every document is a hit, its keys moved to its position): ``naive`` (every document token from the
cache), ``epic`` (each document's first ``--recompute`` tokens computed in context) and ``blend`` (the
``--share`` of document tokens whose KV deviates most at layer 2, computed in context). For each keep
rate, the kept document tokens of each method are compared with joint scoring's (Jaccard), with the gold
paragraphs (share of their tokens kept: HotpotQA's two supporting paragraphs, SQuAD's answer paragraph) and
with the answer (whether its text survives in the kept tokens). Only the draft runs.

    python benchmarks/document_cache.py --task hotpotqa --samples 12 --out benchmarks/results/document_cache/hotpotqa

Results go to ``<out>.json`` (every sample's record and the summary, rewritten after each sample; a
rerun resumes from it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tasks  # noqa: E402

from specprefill_rag.backends.hf import eos_token_ids  # noqa: E402
from specprefill_rag.draft.document_cache import DocumentKVCache  # noqa: E402
from specprefill_rag.draft.model import ModelDraft  # noqa: E402
from specprefill_rag.draft.paths import draft_score  # noqa: E402
from specprefill_rag.draft.repair import DocumentRepair  # noqa: E402
from specprefill_rag.models.loading import load_model  # noqa: E402
from specprefill_rag.prompt.layout import document_runs  # noqa: E402
from specprefill_rag.prompt.render import build_rag_layout  # noqa: E402
from specprefill_rag.selection import select_kept  # noqa: E402

INSTRUCTIONS = "Answer the question using the documents. Be brief."
METHODS = ("naive", "epic", "blend")


def samples_of(task: str, count: int, seed: int) -> list[dict]:
    if task == "hotpotqa":
        return tasks.hotpotqa(count, seed)
    return tasks.squad(count, 10, seed)


def kept_documents(importance: torch.Tensor, layout, keep: float) -> set[int]:
    kept = select_kept(importance, layout.document_index, keep_rate=keep, chunk_size=32)
    return {int(i) for i in kept if int(layout.document_index[i]) >= 0}


def measure(sample: dict, tokenizer, draft_model, keeps: list[float], repairs: dict[str, DocumentRepair]) -> dict:
    """One sample: joint scoring, then each repair in ``repairs`` from a warmed cache, compared at each keep rate."""
    layout = build_rag_layout(tokenizer, sample["question"], sample["documents"], INSTRUCTIONS, True)
    spans = document_runs(layout.document_index)
    eos = eos_token_ids(draft_model, tokenizer)
    store = DocumentKVCache(2**32)
    joint_draft = ModelDraft(draft_model, 8, 13, eos)
    started = time.perf_counter()
    joint = draft_score(joint_draft, layout.input_ids).importance
    joint_ms = (time.perf_counter() - started) * 1000
    warming = ModelDraft(draft_model, 8, 13, eos, document_cache=store)
    started = time.perf_counter()
    with torch.inference_mode():
        warming.warm(layout.input_ids, spans)
    encode_ms = (time.perf_counter() - started) * 1000
    record: dict = {"prompt_tokens": len(layout), "documents": len(sample["documents"]), "joint_ms": joint_ms}
    record["encode_documents_ms"] = encode_ms
    record["load_average_1m"] = os.getloadavg()[0]
    scored = {}
    for method in repairs:
        draft = ModelDraft(draft_model, 8, 13, eos, document_cache=store, repair=repairs[method])
        started = time.perf_counter()
        result = draft_score(draft, layout.input_ids, spans)
        record[f"{method}_ms"] = (time.perf_counter() - started) * 1000
        record[f"{method}_documents_cached"] = result.documents_cached
        scored[method] = result.importance
    gold_tokens = {
        int(i)
        for i in torch.nonzero(layout.document_index >= 0).flatten()
        if int(layout.document_index[i]) in set(sample.get("gold_documents", []))
    }
    answers = [a.lower() for a in sample["answers"]]
    for keep in keeps:
        reference = kept_documents(joint, layout, keep)
        for method, importance in [("joint", joint), *scored.items()]:
            kept = kept_documents(importance, layout, keep)
            text = tokenizer.decode(layout.input_ids[sorted(kept)]).lower() if kept else ""
            key = f"{method}@{keep}"
            record[f"{key}_jaccard"] = len(kept & reference) / max(len(kept | reference), 1)
            record[f"{key}_answer_kept"] = any(a in text for a in answers)
            if gold_tokens:
                record[f"{key}_gold_share"] = len(kept & gold_tokens) / len(gold_tokens)
    return record


def summary(records: list[dict], keeps: list[float], methods: list[str]) -> dict:
    out: dict = {"samples": len(records)}
    for key in records[0]:
        values = [float(r[key]) for r in records if key in r]
        if values:
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            out[key] = {"mean": statistics.mean(values), "median": statistics.median(values), "stdev": spread}
    for keep in keeps:
        for method in methods:
            diffs = [float(r[f"{method}@{keep}_answer_kept"]) - float(r[f"joint@{keep}_answer_kept"]) for r in records]
            out[f"{method}@{keep}_answer_kept_minus_joint"] = _bootstrap(diffs)
    return out


def _bootstrap(values: list[float], rounds: int = 2000) -> dict:
    rng = random.Random(0)
    means = sorted(statistics.mean(rng.choices(values, k=len(values))) for _ in range(rounds))
    return {"mean": statistics.mean(values), "low": means[int(0.025 * rounds)], "high": means[int(0.975 * rounds)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=["hotpotqa", "squad"], default="hotpotqa")
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--recompute", type=int, default=16, help="epic: first tokens of each document recomputed")
    parser.add_argument("--share", type=float, default=0.15, help="blend: share of document tokens recomputed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tasks.require_data()
    torch.set_num_threads(args.threads)
    every = {
        "naive": DocumentRepair("naive"),
        "epic": DocumentRepair("epic", first_tokens=args.recompute),
        "blend": DocumentRepair("blend", share=args.share),
    }
    repairs = {method: every[method] for method in args.methods}
    loaded = load_model(args.draft, "cpu", args.dtype)
    path = Path(args.out + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    records = _recorded(path)
    for index, sample in enumerate(samples_of(args.task, args.samples, args.seed)):
        if index < len(records):
            continue
        record = {"index": index, **measure(sample, loaded.tokenizer, loaded.model, args.keeps, repairs)}
        records.append(record)
        save(path, args, records)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}), flush=True)
    if records:
        save(path, args, records)  # also turns an earlier run's .jsonl into the .json


def _recorded(path: Path) -> list[dict]:
    """The samples measured so far: ``<out>.json``'s records, or the lines of an earlier run's ``<out>.jsonl``."""
    if path.exists() and "records" in (saved := json.loads(path.read_text())):
        return saved["records"]
    lines = path.with_suffix(".jsonl")
    return [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []


def save(path: Path, args: argparse.Namespace, records: list[dict]) -> None:
    """Every record so far and their summary, rewritten after each sample (a rerun resumes from it)."""
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    result = {
        "settings": vars(args),
        "load_average": load,
        "summary": summary(records, args.keeps, args.methods),
        "records": records,
    }
    path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
