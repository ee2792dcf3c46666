"""Cross-tokenizer scoring: what a draft keeps, read through its own tokens or mapped onto another tokenizer's.

A draft of another vocabulary scores the prompt rendered with its own tokenizer; its importance is
carried through the documents' characters onto the main tokenizer's tokens, where chunks and the
budget are formed (``specprefill_rag.draft.mapping``). This study needs only the main model's
*tokenizer*: per sample the draft scores once, then each method selects at each keep rate.

  direct       the draft's selection on its own tokens (what the draft keeps with no mapping)
  mapped-max   mapped onto the main tokens, each taking the max of the draft tokens it overlaps
  mapped-mean  the same with the mean (weighted by shared characters)
  projected    direct's kept characters carried onto the main tokens (each scores the share of its
               characters direct kept), then selected at the same budget: the best any mapping can
               agree with direct once chunks are formed on the main tokens (the ceiling)
  random       random chunks of main tokens at the same budget (the floor)

Metrics: whether a gold answer string survives in the kept document text (normalised as SQuAD's),
whether a gold document kept any token, the kept share of document tokens, and the agreement with
``direct``: the kept document characters of both, intersection over union (1.0 = the mapping keeps
exactly the text the draft keeps on its own tokens).

    python benchmarks/mapping.py --task niah --samples 30 --main-tokenizer qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import tasks
import torch
from quality import INSTRUCTIONS, bootstrap_interval, normalise
from tqdm import tqdm

from specprefill_rag.backends.hf import eos_token_ids
from specprefill_rag.draft.mapping import content_index, map_importance, ranges, token_scores
from specprefill_rag.draft.model import ModelDraft
from specprefill_rag.draft.paths import MappedScoring, score_tokens
from specprefill_rag.models.loading import load_model, load_tokenizer
from specprefill_rag.prompt.layout import PromptLayout
from specprefill_rag.prompt.render import build_rag_layout
from specprefill_rag.selection import select_kept

METHODS = ["direct", "projected", "mapped-max", "mapped-mean", "random"]


def kept_metrics(layout: PromptLayout, tokenizer, kept: torch.Tensor, sample: dict) -> dict[str, float]:
    documents = layout.document_index[kept]
    kept_text = normalise(tokenizer.decode(layout.input_ids[kept][documents >= 0]))
    return {
        "answer_kept": float(any(normalise(a) in kept_text for a in sample["answers"])),
        "gold_document_kept": float(any(int(d) in sample["gold_documents"] for d in documents.unique())),
        "kept_share": float((documents >= 0).sum()) / layout.n_document_tokens,
    }


def kept_characters(layout: PromptLayout, kept: torch.Tensor) -> torch.Tensor:
    """``[C]`` bool: the document characters (joined in prompt order) that kept document tokens cover."""
    content = content_index(layout.document_spans, len(layout.text))
    tokens = kept[layout.document_index[kept] >= 0]
    characters, _ = ranges(layout.offsets[tokens, 0], layout.offsets[tokens, 1] - layout.offsets[tokens, 0])
    mask = torch.zeros(int((layout.document_spans[:, 1] - layout.document_spans[:, 0]).sum()), dtype=torch.bool)
    mask[content[characters]] = True
    return mask


def evaluate_sample(scoring: MappedScoring, main_tokenizer, sample: dict, args) -> list[dict]:
    """Records of every method at every keep rate for one sample (one draft scoring)."""
    main = build_rag_layout(main_tokenizer, sample["question"], sample["documents"], INSTRUCTIONS)
    draft = scoring.draft_layout(main)
    scores = score_tokens(scoring.draft, draft.input_ids)
    importance = {
        "direct": (draft, scores),
        **{
            f"mapped-{reduce}": (
                main,
                map_importance(
                    scores,
                    draft.offsets,
                    draft.document_spans,
                    main.offsets,
                    main.document_index,
                    main.document_spans,
                    reduce,
                ),
            )
            for reduce in ("max", "mean")
        },
        "random": (main, torch.rand(len(main), generator=torch.Generator().manual_seed(args.seed + len(main)))),
    }
    main_content = content_index(main.document_spans, len(main.text))
    records = []
    for keep_rate in args.keep_rates:
        direct = select_kept(scores, draft.document_index, keep_rate=keep_rate, chunk_size=32)
        reference = kept_characters(draft, direct)
        projected = token_scores(reference.float(), main.offsets, main.document_index, main_content, "mean")
        for method, (layout, values) in {**importance, "projected": (main, projected)}.items():
            tokenizer = scoring.tokenizer if layout is draft else main_tokenizer
            kept = select_kept(values, layout.document_index, keep_rate=keep_rate, chunk_size=32)
            characters = kept_characters(layout, kept)
            agreement = float((characters & reference).sum()) / max(int((characters | reference).sum()), 1)
            records.append(
                {
                    "method": method,
                    "keep_rate": keep_rate,
                    "prompt_tokens": len(layout),
                    "agreement": agreement,
                    **kept_metrics(layout, tokenizer, kept, sample),
                }
            )
    return records


def markdown(records: list[dict]) -> str:
    lines = [
        "| method | keep | n | prompt tokens | answer kept (95% CI) | gold document kept | kept share | "
        "agreement with direct (95% CI) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        for keep_rate in sorted({r["keep_rate"] for r in records}):
            chosen = [r for r in records if r["method"] == method and r["keep_rate"] == keep_rate]
            low, high = bootstrap_interval([r["answer_kept"] for r in chosen])
            agreement_low, agreement_high = bootstrap_interval([r["agreement"] for r in chosen])

            def mean(key: str, rows: list[dict] = chosen) -> float:
                return sum(r[key] for r in rows) / len(rows)

            lines.append(
                f"| {method} | {keep_rate:g} | {len(chosen)} | {mean('prompt_tokens'):,.0f} | "
                f"{mean('answer_kept'):.0%} ({low:.0%} to {high:.0%}) | {mean('gold_document_kept'):.0%} | "
                f"{mean('kept_share'):.2f} | {mean('agreement'):.3f} "
                f"({agreement_low:.3f} to {agreement_high:.3f}) |"
            )
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--task", choices=["squad", "niah"], default="niah")
    options.add_argument("--samples", type=int, default=30)
    options.add_argument("--documents", type=int, default=5, help="squad: passages per prompt")
    options.add_argument("--length", type=int, default=2000, help="niah: haystack tokens (draft's tokenizer)")
    options.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    options.add_argument("--draft", default="smollm2-135m")
    options.add_argument("--main-tokenizer", required=True, help="the main model's tokenizer: name, folder or .gguf")
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--out", type=Path)
    args = options.parse_args()
    tasks.require_data()
    draft = load_model(args.draft)
    main_tokenizer = load_tokenizer(args.main_tokenizer)
    eos = eos_token_ids(draft.model, draft.tokenizer)
    drafting = ModelDraft(draft.model, look_ahead=8, pool_kernel=13, eos_token_ids=eos)
    scoring = MappedScoring(drafting, draft.tokenizer, context_length=None, look_ahead=8)
    samples = (
        tasks.niah(args.samples, draft.tokenizer, args.length, args.seed)
        if args.task == "niah"
        else tasks.squad(args.samples, args.documents, args.seed)
    )
    out = args.out or tasks.ROOT / "benchmarks" / "results" / "mapping" / args.task
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    records = []
    for index, sample in enumerate(tqdm(samples, desc=args.task, unit="sample")):
        records += [{"sample": index, **r} for r in evaluate_sample(scoring, main_tokenizer, sample, args)]
        Path(f"{out}.json").write_text(json.dumps({"settings": settings, "records": records}, indent=1))
        Path(f"{out}.md").write_text(markdown(records) + "\n")  # after every sample: a long run can be stopped
    print(markdown(records))


if __name__ == "__main__":
    main()
