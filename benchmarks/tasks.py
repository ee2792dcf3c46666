"""Evaluation tasks built from ../shared/data (read in place, never copied).

Every task yields samples ``{"question", "documents", "answers", "gold_documents"}``; LongBench
samples also carry ``"prompt"``, the official LongBench prompt with ``{context}`` left open, so the
study can lay it out with the documents located inside it.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
NEEDLES = [
    (
        "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
        "What is the best thing to do in San Francisco?",
        ["sandwich", "dolores park"],
    ),
    (
        "The secret ingredient of Grandma Rosa's soup is smoked paprika.",
        "What is the secret ingredient of Grandma Rosa's soup?",
        ["paprika"],
    ),
    ("The access code for the Halvorsen vault is 4417.", "What is the access code for the Halvorsen vault?", ["4417"]),
    (
        "The capital of the fictional island of Veltra is Marisport.",
        "What is the capital of the island of Veltra?",
        ["marisport"],
    ),
    (
        "Doctor Amina Osei keeps her spare keys inside a blue teapot.",
        "Where does Doctor Amina Osei keep her spare keys?",
        ["teapot"],
    ),
]
LONGBENCH_TASKS = ("hotpotqa", "multifieldqa_en", "qasper", "narrativeqa", "triviaqa")
# Bumped when a task draws other samples from the same seed, so that a saved study is not resumed or merged
# with samples of another draw. 2: hotpotqa and nq draw sample i independently of the count (2026-12-01).
SAMPLER_VERSIONS = {"hotpotqa": 2, "nq": 2}


def sampler_version(task: str) -> int:
    return SAMPLER_VERSIONS.get(task, 1)


def recorded_sampler(settings: dict) -> int:
    """The sampler a saved study drew with: runs from before samplers had versions drew with 1."""
    return settings.get("sampler", 1)


def require_data() -> None:
    if not DATA.is_dir():
        raise SystemExit(
            f"evaluation data not found at {DATA}: the benchmarks read ../shared/data next to the repository"
        )


def _insert_at(items: list, item: Any, depth: int) -> list:
    return items[:depth] + [item] + items[depth:]


def _require_count(count: int, available: int, what: str) -> None:
    if count > available:
        raise ValueError(f"{count} samples asked for, but {what} has only {available}: ask for at most {available}")


def _first_of_shuffled(rng: random.Random, items: list, count: int, what: str) -> list:
    """``count`` distinct items; item i does not depend on ``count``, so a study can grow and resume."""
    _require_count(count, len(items), what)
    order = list(items)
    rng.shuffle(order)
    return order[:count]


def squad(count: int, n_documents: int, seed: int) -> list[dict]:
    """A SQuAD v1.1 question's paragraph among paragraphs of other articles, at a random depth."""
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
        samples.append(
            {
                "question": qa["question"],
                "documents": _insert_at(distractors, paragraph["context"], depth),
                "answers": [a["text"] for a in qa["answers"]],
                "gold_documents": [depth],
            }
        )
    return samples


def hotpotqa(count: int, seed: int) -> list[dict]:
    """HotpotQA distractor setting: 10 paragraphs, 2 of them gold (``supporting_facts``)."""
    rows = json.loads((DATA / "hotpotqa" / "hotpotqa_train_distractor_100.json").read_text())
    rng = random.Random(seed)
    samples = []
    for row in _first_of_shuffled(rng, rows, count, "the HotpotQA file"):
        titles = [title for title, _ in row["context"]]
        gold = sorted({titles.index(title) for title, _ in row["supporting_facts"] if title in titles})
        documents = [f"{title}: {''.join(sentences)}" for title, sentences in row["context"]]
        samples.append(
            {"question": row["question"], "documents": documents, "answers": [row["answer"]], "gold_documents": gold}
        )
    return samples


def _nq_passage(row: dict) -> str:
    return f"{row['ctxs'][0]['title']}: {row['ctxs'][0]['text']}"


def nq(count: int, n_documents: int, seed: int) -> list[dict]:
    """NQ-open with its gold passage among gold passages of other questions, at a random depth."""
    with gzip.open(DATA / "lost_in_the_middle" / "nq-open-oracle.jsonl.gz", "rt") as lines:
        rows = [json.loads(line) for line in lines]
    rng = random.Random(seed)
    samples = []
    for index in _first_of_shuffled(rng, list(range(len(rows))), count, "NQ-open"):
        others = [_nq_passage(rows[i]) for i in rng.sample(range(len(rows)), n_documents) if i != index][
            : n_documents - 1
        ]
        depth = rng.randrange(n_documents)
        samples.append(
            {
                "question": rows[index]["question"],
                "documents": _insert_at(others, _nq_passage(rows[index]), depth),
                "answers": rows[index]["answers"],
                "gold_documents": [depth],
            }
        )
    return samples


def niah(count: int, tokenizer: Any, length: int, seed: int, n_documents: int = 5) -> list[dict]:
    """A needle (five kinds) at depths 0-100% of ``length`` tokens of essays split into documents."""
    essays = sorted(p for p in (DATA / "niah_paul_graham").glob("*.txt") if "LICENSE" not in p.name)
    ids = tokenizer("\n\n".join(p.read_text() for p in essays), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    samples = []
    for index in range(count):
        needle, question, answers = NEEDLES[index % len(NEEDLES)]
        start = rng.randrange(len(ids) - length)
        per_document = length // n_documents
        documents = [
            tokenizer.decode(ids[start + i * per_document : start + (i + 1) * per_document]) for i in range(n_documents)
        ]
        depth = (index * 7) % 11 / 10  # 0%, 10%, ... 100% of the haystack, spread over the samples
        target = min(int(depth * n_documents), n_documents - 1)
        sentences = documents[target].split(". ")
        cut = int(len(sentences) * (depth * n_documents - target))
        documents[target] = ". ".join(sentences[:cut] + [needle.rstrip(".")] + sentences[cut:])
        samples.append(
            {
                "question": question,
                "documents": documents,
                "answers": answers,
                "gold_documents": [target],
                "depth": depth,
            }
        )
    return samples


def _truncate_middle(text: str, tokenizer: Any, max_tokens: int) -> str:
    """LongBench's own rule: keep the first and last halves of the budget."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[-half:])


def _passages(context: str) -> list[str]:
    """LongBench multi-document contexts as their passages; other contexts as one document."""
    parts = [p for p in re.split(r"(?=Passage \d+:\n)", context) if p.strip()]
    return parts if len(parts) > 1 else [context]


def longbench(count: int, tokenizer: Any, max_tokens: int, seed: int) -> list[dict]:
    """LongBench v1 samples with the official prompt per task, contexts middle-truncated to ``max_tokens``."""
    prompts = json.loads((DATA / "longbench" / "prompt_configs" / "dataset2prompt.json").read_text())
    rows = []
    for task in LONGBENCH_TASKS:
        rows += [json.loads(line) for line in (DATA / "longbench" / f"{task}.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    samples = []
    _require_count(count, len(rows), f"LongBench ({', '.join(LONGBENCH_TASKS)})")
    for row in rng.sample(rows, count):  # a resumed study checks that its first samples are the same
        context = _truncate_middle(row["context"], tokenizer, max_tokens)
        samples.append(
            {
                "question": row["input"],
                "documents": _passages(context),
                "answers": row["answers"],
                "gold_documents": [],
                "prompt": prompts[row["dataset"]].replace("{input}", row["input"]),
                "dataset": row["dataset"],
            }
        )
    return samples
