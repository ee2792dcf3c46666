"""Per-document draft cache (issue #28): what a warm request costs, and what a skewed workload hits.

``speed``: a corpus of SQuAD v1.1 paragraphs (read in place from ../shared/data) is warmed once with
``engine.warm_documents``. Each request then draws a new combination of corpus paragraphs, in a new order,
to about ``--lengths`` document tokens, with a question about one of them. Per request, side by side in one
process and in an order that rotates from request to request, four arms over the same models:

* ``full``: keep 1.0 (a plain full prefill; one per request, shared by both keep rates);
* ``cold@k``: SpecPrefill at keep ``k``, the draft reading the whole prompt (draft prefix cache off);
* ``cached@k``: the same with ``draft_document_cache=True`` (every document a moved hit).

Every arm generates one token. Reported: TTFT and draft time per arm, and per request the ratios
full / cached, cold / cached (TTFT) and cached / cold (draft time), as medians with min-max.

``zipf``: ``--questions`` questions over a corpus of ``--corpus`` paragraphs; each question retrieves
``--retrieved`` distinct paragraphs drawn with Zipf weights (rank ``r`` weighs ``r ** -s``) and is asked
about one of them. The document cache is sized to about a tenth of the corpus's draft KV and starts
empty (no warm-up): documents enter on first use (a full store admits one only if it was asked for more
often lately than what it would push out; ``--admission lru``: always) and the least recently used leave.
Per question, the cached engine and a cold one (draft joint, no caches) answer the same prompt (one token);
reported: the share of documents served from the cache, TTFT and draft time medians of both.

``draft``: the draft alone (it also answers as the main model, one token; only draft times are read), per
request over a new combination of corpus paragraphs: the cold joint draft, the cache seeing the documents
for the first time (an empty store: every document a miss, encoded alone and stored, then assembled with
blend repair), and the same prompt again from the now warm store with each repair in ``--repairs``; each
with the time of the assembly's phases (documents encoded or looked up, blend's probe, the one forward of
fresh and recomputed tokens, and the scored last token with the look-ahead).

    python benchmarks/document_cache_speed.py speed --out benchmarks/results/document-cache-speed/speed
    python benchmarks/document_cache_speed.py zipf --out benchmarks/results/document-cache-speed/zipf
    python benchmarks/document_cache_speed.py draft --out benchmarks/results/document-cache-speed/draft-phases
    python benchmarks/document_cache_speed.py draft --repairs blend query query:0.05 --out ...  # issue #44
    python benchmarks/document_cache_speed.py draft --draft-layers 12 8 --out ...  # a shorter draft, issue #44
    python benchmarks/document_cache_speed.py draft --first-sights alone in_context --out ...  # first sight, #44

Both rewrite ``<out>.json`` (settings, every record) and ``<out>.md`` after every request and resume
from the JSON (``--resume``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import: a model that is not installed fails, never downloads
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tasks  # noqa: E402

from specprefill_rag import SpecPrefillEngine  # noqa: E402
from specprefill_rag.config import SHARED_REPAIRS  # noqa: E402
from specprefill_rag.draft import assembly  # noqa: E402
from specprefill_rag.draft.document_cache import DocumentKVCache  # noqa: E402
from specprefill_rag.draft.model import ModelDraft  # noqa: E402
from specprefill_rag.draft.repair import DEFAULT_REPAIR, DocumentRepair  # noqa: E402
from specprefill_rag.errors import InvalidRequestError  # noqa: E402
from specprefill_rag.kvcache.admission import KeptEntries  # noqa: E402
from specprefill_rag.models.loading import load_model  # noqa: E402

RATIO = "{:.2f}"
SYSTEM = "Answer the question using the documents. Answer with a short phrase."
# Engine settings of every arm: every prompt compressed, and no exact prefix cache in the draft or the main model
UNCACHED = {"min_prompt_tokens": 0, "draft_cache_mb": 0, "main_cache_mb": 0}


def draft_of(layers: int | None) -> dict[str, Any]:
    """An arm's draft settings: its first ``layers`` layers (which score with the window), or for None the whole draft
    with the paper's look-ahead, these studies' cold and default arms (named, so they stay so whatever the default).
    """
    return {"draft_queries": "look_ahead"} if layers is None else {"draft_layers": layers}


FIELDS = (
    "ttft_ms",
    "draft_ms",
    "main_prefill_ms",
    "prompt_tokens",
    "document_tokens",
    "kept_tokens",
    "compressed",
    "uncompressed_reason",
    "draft_documents_cached",
    "draft_document_cached_tokens",
)


def squad_paragraphs(seed: int) -> list[dict]:
    """Every SQuAD dev paragraph with its first question and answers, shuffled by ``seed``."""
    articles = json.loads((tasks.DATA / "squad" / "dev-v1.1.reconstructed.json").read_text())["data"]
    paragraphs = [
        {
            "text": p["context"],
            "question": p["qas"][0]["question"],
            "answers": [a["text"] for a in p["qas"][0]["answers"]],
        }
        for article in articles
        for p in article["paragraphs"]
        if p["qas"]
    ]
    random.Random(seed).shuffle(paragraphs)
    return paragraphs


def record(result: Any) -> dict:
    return {name: getattr(result.stats, name, None) for name in FIELDS}


def spread(values: list[float], form: str = "{:,.0f}") -> str:
    """Median (min-max) of ``values``, each written with ``form``."""
    if not values:
        return "-"
    median, low, high = (form.format(v) for v in (statistics.median(values), min(values), max(values)))
    return f"{median} ({low}-{high})"


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }


def table_row(cells: list[str]) -> str:
    """One Markdown table row of ``cells``."""
    return "| " + " | ".join(cells) + " |"


def rotated(names: list[str], number: int) -> list[str]:
    """``names`` in the order request ``number`` runs them: rotated by one per request, so no arm always goes first."""
    return names[number % len(names) :] + names[: number % len(names)]


def table_head(title: str, settings: str, report: dict, columns: str) -> list[str]:
    """A run's table up to its rows: the title, settings and machine lines, and the ``", "``-separated columns."""
    names = columns.split(", ")
    header = [table_row(names), "|" + "---|" * len(names)]
    return [title, settings, f"Machine: `{json.dumps(report['machine'])}`", "", *header]


def save(out: Path, report: dict, table: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(table)


def load(out: Path, settings: dict, resume: bool) -> dict:
    path = out.with_suffix(".json")
    if resume and path.exists():
        report = json.loads(path.read_text())
        if report["settings"] != settings:
            raise SystemExit(f"{path} was run with other settings: {report['settings']}")
        return report
    return {"settings": settings, "machine": [], "records": []}


# -- speed ------------------------------------------------------------------------------------------


def repair_of(spec: str) -> DocumentRepair:
    """A ``--repairs`` entry: ``naive``, ``epic``, ``blend``, ``query``, or ``blend:<share>`` / ``query:<share>``
    (the repair computing that share of the cached document tokens again)."""
    kind, _, share = spec.partition(":")
    if share and kind not in SHARED_REPAIRS:
        raise argparse.ArgumentTypeError(f"only blend and query take a share, not {spec!r}")
    return DocumentRepair(kind, share=float(share)) if share else DocumentRepair(kind)  # type: ignore[arg-type]


def repair_spec(spec: str) -> str:
    """``--repairs``' type: the spec itself, once :func:`repair_of` accepts it."""
    try:
        repair_of(spec)
    except (ValueError, InvalidRequestError) as error:
        raise argparse.ArgumentTypeError(f"{spec!r}: {error}") from error
    return spec


def cached_arm(keep: float, repair: str, layers: int | None = None) -> str:
    """The speed study's cached arm: ``cached@k``, ``cached-<repair>@k`` for a repair other than the default, with
    ``-layers<N>`` after ``cached`` for a draft run to its first N layers (``draft_layers``)."""
    draft = "" if layers is None else f"-layers{layers}"
    return f"cached{draft}@{keep:g}" if repair == DEFAULT_REPAIR.kind else f"cached{draft}-{repair}@{keep:g}"


def speed_engines(
    main,
    tokenizer,
    draft,
    keeps: list[float],
    cache_mb: int,
    repairs: list[str],
    draft_layers: list[int | None] | None = None,
) -> dict[str, SpecPrefillEngine]:
    """Each arm its own engine over the same models; the draft prefix cache off everywhere (cold drafts); each
    cached arm its own document store (stores are shared per device and size). ``repairs`` other than the
    default (``blend``) get arms ``cached-<repair>@k``, the repair set on the engine's draft object (no engine
    setting chooses it); each of ``draft_layers`` (None: the whole draft) its own cached arms (the cold arm
    stays the whole draft's, SpecPrefill's default)."""
    engines = {"full": SpecPrefillEngine.from_models(main, tokenizer, draft, keep_rate=1.0, **UNCACHED)}
    sizes = iter(range(cache_mb, 0, -1))
    for keep in keeps:
        engines[f"cold@{keep:g}"] = SpecPrefillEngine.from_models(
            main, tokenizer, draft, keep_rate=keep, document_cache_mb=0, **draft_of(None), **UNCACHED
        )
        for layers, repair in itertools.product(draft_layers or [None], repairs):
            name = cached_arm(keep, repair, layers)
            engines[name] = SpecPrefillEngine.from_models(
                main,
                tokenizer,
                draft,
                keep_rate=keep,
                document_cache_mb=next(sizes),
                draft_document_cache=True,
                **draft_of(layers),
                **UNCACHED,
            )
            engines[name].draft.repair = repair_of(repair)  # type: ignore[attr-defined]
    return engines


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """A text's token count under ``tokenizer`` (no special tokens)."""
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)


def draw(corpus: list[dict], tokens: int, count_tokens, rng: random.Random) -> tuple[list[str], dict]:
    """Paragraphs of ``corpus`` in a random combination and order, about ``tokens`` document tokens, and the one
    the question is about."""
    picked, total = [], 0
    for paragraph in rng.sample(corpus, len(corpus)):
        if total >= tokens:
            break
        picked.append(paragraph)
        total += count_tokens(paragraph["text"])
    return [p["text"] for p in picked], rng.choice(picked)


def run_speed(args) -> None:
    settings = {
        k: getattr(args, k)
        for k in ("main", "draft", "dtype", "lengths", "keeps", "repeats", "seed", "corpus", "repairs")
    }
    if args.repairs == ["blend"]:  # runs from before --repairs recorded no repairs
        settings.pop("repairs")
    if args.draft_layers:  # likewise
        settings["draft_layers"] = args.draft_layers
    report = load(args.out, settings, args.resume)
    report["machine"].append(machine())
    main_loaded, draft_loaded = load_model(args.main, "cpu", args.dtype), load_model(args.draft, "cpu", args.dtype)
    tokenizer = main_loaded.tokenizer
    count = token_counter(tokenizer)
    corpus = squad_paragraphs(args.seed)[: args.corpus]
    corpus_tokens = sum(count(p["text"]) for p in corpus)
    cache_mb = 4096
    variants = [None, *args.draft_layers]
    engines = speed_engines(
        main_loaded.model, tokenizer, draft_loaded.model, args.keeps, cache_mb, args.repairs, variants
    )
    warmed = {}
    for name, engine in engines.items():  # each cached engine its own store (sized apart, so not shared)
        if name.startswith("cached"):
            warmed[name] = engine.warm_documents([p["text"] for p in corpus], SYSTEM)
    report["corpus"] = {"paragraphs": len(corpus), "tokens": corpus_tokens, "warmed": warmed}
    print(json.dumps(report["corpus"]), flush=True)
    done = {(r["length"], r["repeat"]) for r in report["records"]}
    rng = random.Random(args.seed)
    number = 0
    for length in args.lengths:
        for repeat in range(args.repeats):
            documents, target = draw(corpus, length, count, rng)
            number += 1
            if (length, repeat) in done:
                continue
            order = rotated(list(engines), number)
            row: dict[str, Any] = {"length": length, "repeat": repeat, "order": order, "documents": len(documents)}
            for name in order:
                result = engines[name].generate(target["question"], documents, SYSTEM, max_new_tokens=1)
                row[name] = record(result)
            report["records"].append(row)
            save(args.out, report, speed_table(report))
            print(
                json.dumps({"length": length, "repeat": repeat} | {n: round(row[n]["ttft_ms"]) for n in order}),
                flush=True,
            )


def speed_table(report: dict) -> str:
    settings, records = report["settings"], report["records"]
    lines = table_head(
        "Warm requests: every document served from the per-document draft cache, in a new combination and order.",
        f"Settings: `{json.dumps(settings)}`; corpus: `{json.dumps(report.get('corpus'))}`",
        report,
        "doc tokens asked, prompt tokens, keep, repair, cached draft, n, TTFT full ms, TTFT cold ms, TTFT cached ms, "
        "full / cached, "
        "cold / cached, draft ms cold, draft ms cached, cached / cold draft, documents cached",
    )
    for length in settings["lengths"]:
        rows = [r for r in records if r["length"] == length]
        if not rows:
            continue
        variants = [None, *settings.get("draft_layers", [])]
        for keep, layers, repair in itertools.product(settings["keeps"], variants, settings.get("repairs", ["blend"])):
            cold = f"cold@{keep:g}"
            cached = cached_arm(keep, repair, layers)
            lines.append(
                table_row(
                    [
                        f"{length:,}",
                        spread([r["full"]["prompt_tokens"] for r in rows]),
                        f"{keep:g}",
                        repair,
                        "whole" if layers is None else f"first {layers} layers",
                        str(len(rows)),
                        spread([r["full"]["ttft_ms"] for r in rows]),
                        spread([r[cold]["ttft_ms"] for r in rows]),
                        spread([r[cached]["ttft_ms"] for r in rows]),
                        spread([r["full"]["ttft_ms"] / r[cached]["ttft_ms"] for r in rows], RATIO),
                        spread([r[cold]["ttft_ms"] / r[cached]["ttft_ms"] for r in rows], RATIO),
                        spread([r[cold]["draft_ms"] for r in rows]),
                        spread([r[cached]["draft_ms"] for r in rows]),
                        spread([r[cached]["draft_ms"] / r[cold]["draft_ms"] for r in rows], RATIO),
                        spread([r[cached]["draft_documents_cached"] / r["documents"] for r in rows], RATIO),
                    ]
                )
            )
    lines.append("")
    lines.append(
        "Cells: median (min-max) over requests; ratios are per request (arms side by side), then summarised. "
        "TTFT cold: SpecPrefill with the whole draft and no document cache, whatever the cached draft."
    )
    return "\n".join(lines) + "\n"


# -- zipf -------------------------------------------------------------------------------------------


def zipf_questions(corpus: list[dict], questions: int, retrieved: int, exponent: float, seed: int) -> list[dict]:
    """Per question: ``retrieved`` distinct corpus indices drawn with weights ``rank ** -exponent`` (rank = index
    + 1), in the order drawn, and one of them asked about."""
    rng = random.Random(seed)
    weights = [(rank + 1) ** -exponent for rank in range(len(corpus))]
    drawn = []
    for _ in range(questions):
        picked: list[int] = []
        while len(picked) < retrieved:
            index = rng.choices(range(len(corpus)), weights)[0]
            if index not in picked:
                picked.append(index)
        drawn.append({"documents": picked, "about": rng.choice(picked)})
    return drawn


def run_zipf(args) -> None:
    settings = {
        k: getattr(args, k)
        for k in (
            "main",
            "draft",
            "dtype",
            "keep",
            "corpus",
            "questions",
            "retrieved",
            "exponent",
            "seed",
            "cache_share",
        )
    }
    if args.warm_popular:  # named only when used, so runs made before the option existed still resume
        settings["warm_popular"] = args.warm_popular
    if args.repair != DEFAULT_REPAIR.kind:  # likewise
        settings["repair"] = args.repair
    if args.first_sight != "alone":  # likewise
        settings["first_sight"] = args.first_sight
    if args.draft_layers:  # likewise
        settings["draft_layers"] = args.draft_layers
    if args.admission != "lru":  # runs made before admission existed kept their entries least recently used first
        settings["admission"] = args.admission
    report = load(args.out, settings, args.resume)
    report["machine"].append(machine())
    main_loaded, draft_loaded = load_model(args.main, "cpu", args.dtype), load_model(args.draft, "cpu", args.dtype)
    tokenizer = main_loaded.tokenizer
    corpus = squad_paragraphs(args.seed)[: args.corpus]
    corpus_tokens = sum(document_tokens(tokenizer, corpus))
    bytes_per_token = kv_bytes_per_token(draft_loaded.model, args.draft_layers)  # the store holds what it runs
    cache_mb = max(1, round(args.cache_share * corpus_tokens * bytes_per_token / 2**20))
    common = dict(UNCACHED, keep_rate=args.keep)
    cached = SpecPrefillEngine.from_models(
        main_loaded.model,
        tokenizer,
        draft_loaded.model,
        document_cache_mb=cache_mb,
        draft_document_cache=True,
        **draft_of(args.draft_layers),
        **common,
    )
    cached.draft.repair = replace(repair_of(args.repair), first_sight=args.first_sight)  # type: ignore[attr-defined]
    if args.admission == "lru":  # the store without frequency-based admission, as runs before it had
        cached.draft.document_cache = DocumentKVCache(cache_mb * 2**20, admission=False)  # type: ignore[attr-defined]
    cold = SpecPrefillEngine.from_models(
        main_loaded.model, tokenizer, draft_loaded.model, document_cache_mb=0, **draft_of(None), **common
    )
    report["corpus"] = {"paragraphs": len(corpus), "tokens": corpus_tokens, "cache_mb": cache_mb}
    questions = zipf_questions(corpus, args.questions, args.retrieved, args.exponent, args.seed)
    if args.rerun_from is not None:
        report["records"] = report["records"][: args.rerun_from]
        for mark in ("restarts", "resumes"):  # resumptions (runs before rebuilt stores: "restarts") of dropped records
            kept = [r for r in report.get(mark, []) if (r if isinstance(r, int) else r["at"]) < args.rerun_from]
            report.pop(mark, None)
            if kept:
                report[mark] = kept
    if report["records"]:  # resumed: the store an uninterrupted run would hold now, drafted again
        done = len(report["records"])
        held = rebuild_store(cached, corpus, questions[:done], report["records"], args.warm_popular)
        report.setdefault("resumes", []).append({"at": len(report["records"]), "store": "rebuilt", "held": held})
    elif args.warm_popular:
        report["warmed"] = warm_popular(cached, corpus, args.warm_popular)
    for number, question in enumerate(questions):
        if number < len(report["records"]):
            continue
        documents = [corpus[i]["text"] for i in question["documents"]]
        about = corpus[question["about"]]
        row: dict[str, Any] = {"question": number, "documents": question["documents"]}
        for name, engine in (("cached", cached), ("cold", cold))[:: 1 if number % 2 else -1]:
            row[name] = record(engine.generate(about["question"], documents, SYSTEM, max_new_tokens=1))
        row["cache_bytes"] = cached.document_cache.nbytes
        report["records"].append(row)
        save(args.out, report, zipf_table(report))
        print(
            json.dumps(
                {
                    "q": number,
                    "hit": row["cached"]["draft_documents_cached"],
                    "cached": round(row["cached"]["ttft_ms"]),
                    "cold": round(row["cold"]["ttft_ms"]),
                }
            ),
            flush=True,
        )


def document_tokens(tokenizer: Any, corpus: list[dict]) -> list[int]:
    """Each paragraph's token count, tokenized alone."""
    return [len(tokenizer(p["text"], add_special_tokens=False).input_ids) for p in corpus]


def kv_bytes_per_token(model: Any, layers: int | None = None) -> int:
    """Bytes of one token's draft KV (keys and values of every layer the draft runs: ``layers``, default all) in
    the model's dtype."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers if layers is None else layers
    return 2 * layers * config.num_key_value_heads * head_dim * model.dtype.itemsize


def replay_store(
    requests: list[list[tuple[int, int]]],
    budget: int,
    pinned: dict[int, int] | None = None,
    admission: bool = True,
) -> tuple[int, KeptEntries[int]]:
    """A document store replayed on entry sizes alone, through the policy :class:`DocumentKVCache` keeps its
    entries by (:class:`KeptEntries`: least recently used first out, with frequency-based admission unless
    ``admission`` is False).

    Args:
        requests: per request, its documents in prompt order as ``(document, entry bytes)``; each is looked up,
            and stored when missed.
        budget: the bytes the documents may hold (the store's bound less its prefix entry).
        pinned: documents held from the start and never evicted (their bytes count against ``budget``).

    Returns:
        The lookups that hit, and the policy's state at the end (the other documents held, least recently used
        first).
    """
    pinned = pinned or {}
    kept: KeptEntries[int] = KeptEntries(max(budget - sum(pinned.values()), 0), admission)
    hits = 0
    for request in requests:
        for document, size in request:
            if document in pinned:
                hits += 1
                continue
            kept.looked_up(document)
            if document in kept:
                hits += 1
            else:
                kept.admit(document, size)
    return hits, kept


def warm_popular(engine: SpecPrefillEngine, corpus: list[dict], count: int) -> int:
    """Warm the ``count`` most popular paragraphs (the Zipf ranks 1..count) at ingestion, the most popular last
    (most recently used); returns the documents the store then holds."""
    return sum(engine.warm_documents([corpus[index]["text"]], SYSTEM) for index in reversed(range(count)))


def rebuild_store(
    engine: SpecPrefillEngine, corpus: list[dict], asked: list[dict], records: list[dict], warmed: int
) -> int:
    """Bring ``engine``'s empty document store to what it held after ``asked`` (questions from
    :func:`zipf_questions`; ``records``: their rows), so a resumed run goes on as an uninterrupted one would:
    the ``warmed`` most popular paragraphs are warmed again, and every question asked again (one token), in
    order, which repeats every lookup and store the store saw (its entries, their order and its admission
    counts); each question must find as many documents held as it did (checked). Returns the documents held.
    """
    warm_popular(engine, corpus, warmed)
    for question, row in zip(asked, records):
        documents = [corpus[i]["text"] for i in question["documents"]]
        again = engine.generate(corpus[question["about"]]["question"], documents, SYSTEM, max_new_tokens=1)
        if again.stats.draft_documents_cached != row["cached"]["draft_documents_cached"]:
            raise SystemExit(f"rebuilt store: question {row['question']} found other documents held than it did")
    return len(engine.document_cache) - 1


def run_replay(args) -> None:
    """Hit rates of the Zipf workload's store replayed on entry sizes (no model runs): least recently used first
    out with and without frequency-based admission, each with the ``--pin`` most popular paragraphs pinned (held
    from the start, never evicted)."""
    settings = {k: getattr(args, k) for k in ("draft", "corpus", "questions", "retrieved", "exponent", "seed")}
    settings.update(cache_share=args.cache_share, pin=args.pin, admission=args.admissions)
    draft = load_model(args.draft, "cpu", args.dtype)
    corpus = squad_paragraphs(args.seed)[: args.corpus]
    sizes = [tokens * kv_bytes_per_token(draft.model) for tokens in document_tokens(draft.tokenizer, corpus)]
    budget = max(1, round(args.cache_share * sum(sizes) / 2**20)) * 2**20
    questions = zipf_questions(corpus, args.questions, args.retrieved, args.exponent, args.seed)
    requests = [[(i, sizes[i]) for i in question["documents"]] for question in questions]
    asked = sum(len(request) for request in requests)
    rows = []
    for admission, count in itertools.product(args.admissions, args.pin):
        pinned: dict[int, int] = {}
        room = budget
        for index in range(count):  # the most popular first, while they fit
            if sizes[index] <= room:
                pinned[index], room = sizes[index], room - sizes[index]
        hits, _ = replay_store(requests, budget, pinned, admission == "frequency")
        row = {"admission": admission, "pin": count, "pinned": len(pinned), "hits": hits, "asked": asked}
        rows.append(row | {"hit_rate": hits / asked})
    report = {"settings": settings, "machine": [machine()], "records": rows}
    save(args.out, report, replay_table(report))


def replay_table(report: dict) -> str:
    lines = [
        f"Settings: `{json.dumps(report['settings'])}`",
        "",
        "| admission | pinned (most popular first) | documents asked | hits | hit rate |",
        "|---|---|---|---|---|",
        *(
            f"| {r.get('admission', 'lru')} | {r['pinned']} | {r['asked']:,} | {r['hits']:,} | {r['hit_rate']:.3f} |"
            for r in report["records"]
        ),
        "",
        "The store replayed on entry sizes (paragraphs tokenized alone, the draft's KV bytes per token), without "
        "its prefix entry, through the policy the store keeps its entries by: least recently used first out, and "
        "with `frequency` admission a document enters a full store only if it was looked up more often lately "
        "than each entry it would push out. Pinned paragraphs are held from the start and never evicted. No "
        "model runs: hit rates, not times.",
    ]
    return "\n".join(lines) + "\n"


def zipf_table(report: dict) -> str:
    records, settings = report["records"], report["settings"]
    hits = sum(r["cached"]["draft_documents_cached"] for r in records)
    asked = sum(len(r["documents"]) for r in records)
    distinct = len({d for r in records for d in r["documents"]})
    lines = [
        f"Settings: `{json.dumps(settings)}`; corpus: `{json.dumps(report.get('corpus'))}`",
        f"Machine: `{json.dumps(report['machine'])}`",
        "",
        "| questions | documents asked | distinct documents | served from the cache | hit rate | TTFT cached ms | "
        "TTFT cold ms | cold / cached TTFT | draft ms cached | draft ms cold |",
        "|---|---|---|---|---|---|---|---|---|---|",
        table_row(
            [
                str(len(records)),
                str(asked),
                str(distinct),
                str(hits),
                f"{hits / asked:.2f}" if asked else "-",
                spread([r["cached"]["ttft_ms"] for r in records]),
                spread([r["cold"]["ttft_ms"] for r in records]),
                spread([r["cold"]["ttft_ms"] / r["cached"]["ttft_ms"] for r in records], RATIO),
                spread([r["cached"]["draft_ms"] for r in records]),
                spread([r["cold"]["draft_ms"] for r in records]),
            ]
        ),
        "",
        "Cells: median (min-max) over questions; the cold/cached ratio is per question (both engines answer the "
        "same prompt, alternating which goes first), then summarised. The hit rate counts documents served from "
        "the cache over documents asked; "
        + (
            f"the {settings['warm_popular']} most popular paragraphs were warmed before the first question."
            if settings.get("warm_popular")
            else "the cache starts empty and has no warm-up."
        ),
    ]
    return "\n".join(lines) + "\n"


# -- draft ------------------------------------------------------------------------------------------

PHASES = {  # the assembly's steps, timed where the draft calls them
    "encode_documents": (assembly, "encode_documents"),  # documents looked up, or encoded alone and stored
    "probe": (assembly, "_recomputed"),  # blend's joint probe or query's question pass, and the choice of tokens
    "place": (assembly, "_placed"),  # cached keys rotated to their positions, KV copied into the prompt's
    "fresh_forward": (assembly, "_with_fresh"),  # labels, question and recomputed tokens, in context
    "score": (ModelDraft, "_score_from"),  # the last token and the look-ahead, scored
}


@contextmanager
def phase_timer() -> Iterator[dict[str, float]]:
    """Milliseconds spent in each of :data:`PHASES` during the ``with`` body (the originals restored after)."""
    spent = dict.fromkeys(PHASES, 0.0)
    originals = {name: getattr(owner, attribute) for name, (owner, attribute) in PHASES.items()}

    def timed(name: str, function: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += (time.perf_counter() - started) * 1000.0

        return run

    try:
        for name, (owner, attribute) in PHASES.items():
            setattr(owner, attribute, timed(name, originals[name]))
        yield spent
    finally:
        for name, (owner, attribute) in PHASES.items():
            setattr(owner, attribute, originals[name])


def draft_arm(engine: SpecPrefillEngine, documents: list[str], question: str) -> dict:
    with phase_timer() as spent:
        result = engine.generate(question, documents, SYSTEM, max_new_tokens=1)
    return record(result) | {"phases_ms": dict(spent)}


def run_draft(args) -> None:
    settings = {k: getattr(args, k) for k in ("draft", "dtype", "lengths", "keep", "repeats", "seed", "repairs")}
    if args.draft_layers:  # named only when used, so runs made before the option existed still resume
        settings["draft_layers"] = args.draft_layers
    if args.first_sights != ["alone"]:  # likewise
        settings["first_sights"] = args.first_sights
    if args.warm_layers:  # likewise
        settings["warm_layers"] = args.warm_layers
    report = load(args.out, settings, args.resume)
    report["machine"].append(machine())
    loaded = load_model(args.draft, "cpu", args.dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    count = token_counter(tokenizer)
    corpus = squad_paragraphs(args.seed)[:200]
    common = dict(UNCACHED, keep_rate=args.keep)
    cold = SpecPrefillEngine.from_models(model, tokenizer, model, document_cache_mb=0, **draft_of(None), **common)
    shorter = {
        f"cold-layers{n}": SpecPrefillEngine.from_models(
            model, tokenizer, model, document_cache_mb=0, draft_layers=n, **common
        )
        for n in args.draft_layers
    }
    done = {(r["length"], r["repeat"]) for r in report["records"]}
    rng = random.Random(args.seed)
    for number, (length, repeat) in enumerate(itertools.product(args.lengths, range(args.repeats))):
        documents, target = draw(corpus, length, count, rng)
        if (length, repeat) in done:
            continue
        row: dict[str, Any] = {"length": length, "repeat": repeat, "documents": len(documents)}
        row["cold"] = draft_arm(cold, documents, target["question"])
        for name, engine in shorter.items():
            row[name] = draft_arm(engine, documents, target["question"])
        stores = {}
        for sight, size in zip(args.first_sights, (4096 - number, 2048 - number)):
            stores[sight] = SpecPrefillEngine.from_models(  # a new, empty store (shared per device and size)
                model, tokenizer, model, document_cache_mb=size, draft_document_cache=True, **draft_of(None), **common
            )
            stores[sight].draft.repair = replace(DEFAULT_REPAIR, first_sight=sight)  # type: ignore[attr-defined]
            row[first_arm(sight)] = draft_arm(stores[sight], documents, target["question"])
        cached = stores.get("alone", stores[args.first_sights[0]])  # the warm arms: documents as drafted alone
        for repair in args.repairs:
            cached.draft.repair = repair_of(repair)  # type: ignore[attr-defined]
            row[f"warm-{repair}"] = draft_arm(cached, documents, target["question"])
        for n in args.warm_layers:
            truncated = SpecPrefillEngine.from_models(  # its own store: the cache is keyed by the draft's layers
                model,
                tokenizer,
                model,
                document_cache_mb=1024 - number,
                draft_document_cache=True,
                draft_layers=n,
                **common,
            )
            row[f"first-layers{n}"] = draft_arm(truncated, documents, target["question"])
            for repair in args.repairs:
                truncated.draft.repair = repair_of(repair)  # type: ignore[attr-defined]
                row[f"warm-layers{n}-{repair}"] = draft_arm(truncated, documents, target["question"])
        report["records"].append(row)
        save(args.out, report, draft_table(report))
        print(json.dumps({"length": length, "repeat": repeat, "cold": round(row["cold"]["draft_ms"])}), flush=True)


def phase_cell(phases: list[dict[str, float]], name: str) -> str:
    """One phase's ms over requests; ``-`` for runs made before the phase was timed."""
    return spread([p[name] for p in phases]) if all(name in p for p in phases) else "-"


def first_arm(sight: str) -> str:
    """The draft study's arm of a first sight: ``first`` (documents drafted alone), ``first-in_context``."""
    return "first" if sight == "alone" else f"first-{sight}"


def draft_table(report: dict) -> str:
    settings, records = report["settings"], report["records"]
    shorter = [f"cold-layers{n}" for n in settings.get("draft_layers", [])]
    firsts = [first_arm(sight) for sight in settings.get("first_sights", ["alone"])]
    arms = [*shorter, *firsts, *(f"warm-{repair}" for repair in settings["repairs"])]
    for n in settings.get("warm_layers", []):
        arms += [f"first-layers{n}", *(f"warm-layers{n}-{repair}" for repair in settings["repairs"])]
    lines = table_head(
        "The draft's time on the per-document cache path against a cold joint draft (the same prompt, one process).",
        f"Settings: `{json.dumps(settings)}`",
        report,
        "doc tokens asked, prompt tokens, arm, n, draft ms, / cold draft, encode documents, probe, place, "
        "fresh forward, score + look-ahead",
    )
    for length in settings["lengths"]:
        rows = [r for r in records if r["length"] == length]
        if not rows:
            continue
        prompt = spread([r["cold"]["prompt_tokens"] for r in rows])
        lines.append(
            f"| {length:,} | {prompt} | cold (joint) | {len(rows)} | {spread([r['cold']['draft_ms'] for r in rows])} "
            "| 1 | - | - | - | - | - |"
        )
        for arm in arms:
            phases = [phase_cell([r[arm]["phases_ms"] for r in rows], name) for name in PHASES]
            ratio = spread([r[arm]["draft_ms"] / r["cold"]["draft_ms"] for r in rows], RATIO)
            draft = spread([r[arm]["draft_ms"] for r in rows])
            lines.append(
                f"| {length:,} | {prompt} | {arm} | {len(rows)} | {draft} | {ratio} | " + " | ".join(phases) + " |"
            )
    lines += [
        "",
        "Arms: `cold-layers<N>`: a cold joint draft of the draft's first N layers (`draft_layers`; its phases are not "
        "timed); `first`: an empty store, every document encoded alone and stored, then assembled (blend); "
        "`first-in_context`: an empty store, the documents computed in the scoring pass and stored from it;",
        "`warm-<repair>`: the same prompt again, every document a hit; `first-layers<N>`, "
        "`warm-layers<N>-<repair>`: the same on a store of the draft's first N layers. Cells: median (min-max) "
        "over requests, in ms; ratios per request.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    studies = parser.add_subparsers(dest="study", required=True)
    for name in ("speed", "zipf", "draft", "replay"):
        sub = studies.add_parser(name)
        sub.add_argument("--main", default="qwen2.5-coder-1.5b")
        sub.add_argument("--draft", default="qwen2.5-coder-0.5b")
        sub.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--threads", type=int, default=2)
        sub.add_argument("--resume", action="store_true")
        sub.add_argument("--out", type=Path, required=True)
        sub.add_argument("--report", action="store_true", help="rewrite <out>.md from <out>.json; run nothing")
    speed = studies.choices["speed"]
    speed.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000, 8000], help="document tokens per prompt")
    speed.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    speed.add_argument("--repeats", type=int, default=3)
    speed.add_argument("--corpus", type=int, default=80, help="paragraphs warmed and drawn from")
    speed.add_argument(
        "--repairs",
        nargs="+",
        default=["blend"],
        type=repair_spec,
        help="cached arms' repairs (blend:<share>, query:<share> too)",
    )
    speed.add_argument(
        "--draft-layers",
        type=int,
        nargs="*",
        default=[],
        help="cached arms also with the draft's first N layers (draft_layers), each its own store",
    )
    draft = studies.choices["draft"]
    draft.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000], help="document tokens per prompt")
    draft.add_argument("--keep", type=float, default=0.1)
    draft.add_argument("--repeats", type=int, default=3)
    draft.add_argument(
        "--repairs", nargs="+", default=["blend", "naive"], type=repair_spec, help="blend:<share>, query:<share> too"
    )
    draft.add_argument(
        "--first-sights",
        nargs="+",
        default=["alone"],
        choices=["alone", "in_context"],
        help="first-sight arms (document_first_sight; in_context: misses computed in the scoring pass)",
    )
    draft.add_argument(
        "--draft-layers",
        type=int,
        nargs="+",
        default=[],
        help="also a cold joint draft of the draft's first N layers (draft_layers=N; its queries: the last 16 tokens)",
    )
    draft.add_argument(
        "--warm-layers",
        type=int,
        nargs="+",
        default=[],
        help="also first-sight and warm arms on a document store of the draft's first N layers (draft_layers=N)",
    )
    zipf = studies.choices["zipf"]
    zipf.add_argument("--keep", type=float, default=0.1)
    for workload in (zipf, studies.choices["replay"]):
        workload.add_argument("--corpus", type=int, default=500)
        workload.add_argument("--questions", type=int, default=100)
        workload.add_argument("--retrieved", type=int, default=10)
        workload.add_argument("--exponent", type=float, default=1.0)
        workload.add_argument(
            "--cache-share", type=float, default=0.1, help="cache size as a share of the corpus's draft KV"
        )
    studies.choices["replay"].add_argument(
        "--pin", type=int, nargs="+", default=[0, 10, 20, 30, 40, 50], help="most popular paragraphs pinned"
    )
    studies.choices["replay"].add_argument(
        "--admissions", nargs="+", default=["lru", "frequency"], choices=["lru", "frequency"]
    )
    zipf.add_argument(
        "--admission",
        default="frequency",
        choices=["frequency", "lru"],
        help="the store's admission: frequency (the store's default) or lru (every document enters, as before it)",
    )
    zipf.add_argument(
        "--repair", default=DEFAULT_REPAIR.kind, type=repair_spec, help="the cached engine's repair (query:0.1...)"
    )
    zipf.add_argument(
        "--first-sight", default="alone", choices=["alone", "in_context"], help="the cached engine's first sight"
    )
    zipf.add_argument(
        "--draft-layers",
        type=int,
        help="the cached engine's draft run to its first N layers (the cold engine keeps the whole draft); the "
        "cache is sized to a share of the corpus's KV of those layers",
    )
    zipf.add_argument(
        "--warm-popular", type=int, default=0, help="warm the N most popular paragraphs before the first question"
    )
    zipf.add_argument(
        "--rerun-from", type=int, help="with --resume: drop the records from this question on and run them again"
    )
    args = parser.parse_args(argv)
    if args.report:
        report = json.loads(args.out.with_suffix(".json").read_text())
        tables = {"speed": speed_table, "zipf": zipf_table, "draft": draft_table, "replay": replay_table}
        args.out.with_suffix(".md").write_text(tables[args.study](report))
        return
    torch.set_num_threads(args.threads)
    {"speed": run_speed, "zipf": run_zipf, "draft": run_draft, "replay": run_replay}[args.study](args)


if __name__ == "__main__":
    main()
