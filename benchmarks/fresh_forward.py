"""The per-document cache's fresh forward: grouped queries against one mask over every key (issue #44).

A cached draft computes its fresh tokens (misses, recomputed tokens, labels, the question) in one forward over
the placed KV; each fresh query may read the keys up to its own position. ``assembly._masked_attention`` puts
the keys in position order and the queries in groups that each read only the keys up to their latest position,
through an additive mask. The reference here is what it replaced: transformers' SDPA with one bool
``[F, C + F]`` mask over every key. Both arms run ``assembly._with_fresh`` on the same placed KV of the draft,
in one process, alternating, ``--repeats`` times per setting; the token ids are random (the cost does not
depend on them) and the fresh positions a seeded random share of the prompt plus its last 30 tokens.

    python benchmarks/fresh_forward.py --out benchmarks/results/document-cache-speed/fresh-forward
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

from document_cache_speed import machine, save, spread  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from specprefill_rag.draft import assembly  # noqa: E402
from specprefill_rag.models.loading import load_model  # noqa: E402

GROUPED = assembly._masked_attention
SETTINGS = [(1600, 0.6), (4200, 0.17)]  # (prompt tokens, share fresh): a partial hit at 1.6k, a warm 4k blend


def one_mask(key_positions: torch.Tensor, query_positions: torch.Tensor, observe: Any = None) -> Any:
    """The reference: SDPA with one bool ``[F, C + F]`` mask over every key (cache slot order); ``observe`` is
    ``assembly._masked_attention``'s, unused here (the study's warm arms score no window)."""
    mask = (key_positions[None, :] <= query_positions[:, None])[None, None]

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)

    return attention


def timed_fresh(model: Any, ids: torch.Tensor, full: list, cached: torch.Tensor, masked: Any) -> tuple[float, list]:
    """Seconds of one ``_with_fresh`` with ``masked`` as the attention, and the KV it wrote."""
    assembly._masked_attention = masked
    try:
        copy = [(keys.clone(), values.clone()) for keys, values in full]
        started = time.perf_counter()
        assembly._with_fresh(model, model.config.num_hidden_layers, ids, copy, cached)
        return time.perf_counter() - started, copy
    finally:
        assembly._masked_attention = GROUPED


@torch.inference_mode()
def run_setting(model: Any, length: int, share: float, repeats: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator)
    past = assembly._new_cache(model)
    assembly._forward(model, model.config.num_hidden_layers, ids, torch.arange(length), past)
    full = [(layer.keys.clone(), layer.values.clone()) for layer in past.layers]
    cached = torch.rand(length, generator=generator) > share
    cached[-30:] = False  # the question and the last token
    seconds: dict[str, list[float]] = {"one_mask": [], "grouped": []}
    written = {}
    for _ in range(repeats):
        for name, masked in (("one_mask", one_mask), ("grouped", GROUPED)):
            spent, written[name] = timed_fresh(model, ids, full, cached, masked)
            seconds[name].append(spent)
    difference = max(
        float((a.float() - b.float()).norm() / a.float().norm())
        for (ka, va), (kb, vb) in zip(written["one_mask"], written["grouped"])
        for a, b in ((ka, kb), (va, vb))
    )
    ratios = [g / o for g, o in zip(seconds["grouped"], seconds["one_mask"])]
    return {
        "prompt_tokens": length,
        "fresh_tokens": int((~cached).sum()),
        "seconds": seconds,
        "grouped_over_one_mask": ratios,
        "largest_relative_difference": difference,
    }


def table(report: dict) -> str:
    lines = [
        f"Settings: `{json.dumps(report['settings'])}`",
        f"Machine: `{json.dumps(report['machine'])}`",
        "",
        "| prompt tokens | fresh tokens | one mask s | grouped s | grouped / one mask | KV difference (relative) |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["records"]:
        one, grouped, ratios = r["seconds"]["one_mask"], r["seconds"]["grouped"], r["grouped_over_one_mask"]
        lines.append(
            f"| {r['prompt_tokens']:,} | {r['fresh_tokens']:,} | {spread(one, '{:.3f}')} | {spread(grouped, '{:.3f}')} "
            f"| {spread(ratios, '{:.2f}')} | {r['largest_relative_difference']:.4f} |"
        )
    lines += [
        "",
        "Cells: median (min-max) over repeats; the ratio per repeat (the arms alternate). KV difference: the "
        "largest relative norm of the difference between the two arms' keys or values over the layers (rounding "
        "in the model's dtype; the two are equal in float32, tests/test_document_cache.py).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.draft, "cpu", args.dtype).model
    settings = {"draft": args.draft, "dtype": args.dtype, "repeats": args.repeats, "seed": args.seed}
    report = {"settings": settings | {"settings": SETTINGS}, "machine": [machine()], "records": []}
    for length, share in SETTINGS:
        report["records"].append(run_setting(model, length, share, args.repeats, args.seed))
        save(args.out, report, table(report))
        print(json.dumps(report["records"][-1]["grouped_over_one_mask"]), flush=True)


if __name__ == "__main__":
    main()
