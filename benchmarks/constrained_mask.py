"""Per-token cost of JSON-schema constrained decoding masks on CPU: xgrammar against llguidance (issue #30).

For each tokenizer (a folder with tokenizer files, loaded offline) and each library, the script

* builds the library's tokenizer view once (xgrammar ``TokenizerInfo.from_huggingface``, llguidance
  ``llguidance.hf.from_tokenizer``) and reports how long that took;
* compiles two grammars: ``rag_answer`` -- a JSON schema typical of a RAG structured answer
  (``{"answer": str, "citations": [int], "confidence": number in [0, 1]}``, all required, no extra keys) -- and
  ``json_object`` (any JSON object, ``{"type": "object"}``, which is what vLLM compiles for
  ``response_format={"type": "json_object"}`` with either library);
* feeds a valid answer (``json.dumps`` of a RAG answer, tokenized by the tokenizer, then EOS) token by token,
  and at every position times what a transformers decode loop has to do: compute the next-token bitmask, apply it
  to a float32 logits tensor of shape ``[1, V]`` (V = the model's logits width: ``config.json``'s ``vocab_size``
  when the folder has one, else the tokenizer's length), and advance the matcher with the token;
* checks correctness: with random logits, the masked argmax sequence must parse as JSON valid for the schema.

The libraries run interleaved in one process (their order alternates every repeat) with one torch thread, so load
from other processes on a shared machine hits both alike; medians and min-max are over ``--repeats`` runs. The
results file is rewritten after every measurement.

    python benchmarks/constrained_mask.py --tokenizer /path/to/smollm2 --tokenizer /path/to/qwen \\
        --repeats 7 --tokens 200 --out benchmarks/results/constrained-mask/run.json

xgrammar and llguidance are not core dependencies: ``pip install 'specprefill-rag[constrained]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# One thread everywhere, before torch (and the libraries' native pools) start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LIBRARIES = ("xgrammar", "llguidance")

RAG_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "citations": {"type": "array", "items": {"type": "integer"}},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["answer", "citations", "confidence"],
    "additionalProperties": False,
}
GRAMMARS = {"rag_answer": RAG_SCHEMA, "json_object": {"type": "object"}}

_SENTENCES = [
    "The Eiffel Tower was completed in 1889 for the Exposition Universelle in Paris [1].",
    "It was designed by the engineering company of Gustave Eiffel, whose name it bears [2].",
    "At 330 metres it remained the tallest man-made structure in the world until 1930 [1][3].",
    "The tower receives close to seven million visitors a year, most of them from abroad [4].",
    "Its iron lattice is repainted every seven years, which takes about 60 tonnes of paint [2].",
    'During the "Belle Époque" critics called it useless and monstrous; they later relented.',
]

_INSTALL_HINT = (
    "{name} is not installed: the constrained-decoding benchmark needs the `constrained` extra, "
    "`pip install 'specprefill-rag[constrained]'` (or `pip install xgrammar llguidance`)."
)


def _import(name: str):
    try:
        return __import__(name)
    except ImportError as exc:
        raise SystemExit(_INSTALL_HINT.format(name=name)) from exc


def answer_text(tokenizer, target_tokens: int) -> str:
    """A valid RAG answer (compact JSON) whose tokenization is at least ``target_tokens`` long (or all sentences)."""
    sentences: list[str] = []
    text = ""
    i = 0
    while True:
        sentences.append(_SENTENCES[i % len(_SENTENCES)])
        i += 1
        obj = {"answer": " ".join(sentences), "citations": [1, 2, 3, 4], "confidence": 0.87}
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        if len(tokenizer.encode(text, add_special_tokens=False)) >= target_tokens or i >= 200:
            return text


def validate(text: str, grammar: str) -> tuple[bool, str]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        return False, f"not JSON: {exc}"
    schema = GRAMMARS[grammar]
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            return False, f"schema: {exc.message}"
        return True, "jsonschema"
    if not isinstance(value, dict):
        return False, "not an object"
    if grammar == "rag_answer":
        ok = (
            set(value) == {"answer", "citations", "confidence"}
            and isinstance(value["answer"], str)
            and isinstance(value["citations"], list)
            and all(isinstance(c, int) and not isinstance(c, bool) for c in value["citations"])
            and isinstance(value["confidence"], (int, float))
            and 0 <= value["confidence"] <= 1
        )
        return ok, "by hand"
    return True, "by hand"


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, compile_threads: int):
        self.xgr = _import("xgrammar")
        t0 = time.perf_counter()
        self.info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.vocab = vocab
        self.compile_threads = compile_threads
        self.version = self.xgr.__version__ if hasattr(self.xgr, "__version__") else _dist_version("xgrammar")

    def compile(self, grammar: str):
        # A fresh compiler without a cache each time, so every repeat pays the full compile.
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.compile_threads, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(GRAMMARS[grammar]), any_whitespace=False, separators=(",", ":")
        )
        ms = (time.perf_counter() - t0) * 1e3
        return compiled, ms, int(compiled.memory_size_bytes)

    def matcher(self, compiled):
        return _XgrMatcher(self.xgr, compiled, self.vocab)


class _XgrMatcher:
    def __init__(self, xgr, compiled, vocab):
        self.xgr = xgr
        self.m = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

    def fill(self):
        self.m.fill_next_token_bitmask(self.bitmask, 0)

    def apply(self, logits):
        self.xgr.apply_token_bitmask_inplace(logits, self.bitmask)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def done(self) -> bool:
        return bool(self.m.is_terminated())

    def error(self) -> str:
        return ""


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, compile_threads: int):
        self.llg = _import("llguidance")
        import llguidance.hf
        import llguidance.torch

        self.llg_torch = llguidance.torch
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.vocab = vocab
        self.version = self.llg.__version__

    def compile(self, grammar: str):
        # llguidance compiles in the LLMatcher constructor (and builds the lexer lazily while matching): the
        # compile time is grammar_from_json_schema + validation + the constructor, the rest shows in the first mask.
        LLMatcher = self.llg.LLMatcher
        t0 = time.perf_counter()
        grm = LLMatcher.grammar_from_json_schema(
            json.dumps(GRAMMARS[grammar]), overrides={"whitespace_flexible": False}
        )
        matcher = LLMatcher(self.tok, grm, log_level=1)
        ms = (time.perf_counter() - t0) * 1e3
        if matcher.is_error():
            raise RuntimeError(f"llguidance could not compile {grammar}: {matcher.get_error()}")
        return (grm, matcher), ms, None

    def matcher(self, compiled):
        grm, first = compiled
        # The first matcher comes from compile(), so its lazy work is part of this run; later ones are new.
        m = first if first is not None else self.llg.LLMatcher(self.tok, grm, log_level=1)
        return _LlgMatcher(self.llg_torch, m, self.vocab)


class _LlgMatcher:
    def __init__(self, llg_torch, m, vocab):
        self.t = llg_torch
        self.m = m
        self.bitmask = llg_torch.allocate_token_bitmask(1, vocab)

    def fill(self):
        self.t.fill_next_token_bitmask(self.m, self.bitmask, 0)

    def apply(self, logits):
        self.t.apply_token_bitmask_inplace(logits, self.bitmask)

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(token))

    def done(self) -> bool:
        return bool(self.m.is_stopped())

    def error(self) -> str:
        return self.m.get_error() if self.m.is_error() else ""


BACKENDS = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def feed(matcher, tokens: list[int], base_logits) -> dict:
    """Mask + apply + accept at every position of ``tokens``; per-token microseconds for each part."""
    import torch

    fill_us, apply_us, accept_us = [], [], []
    logits = torch.empty_like(base_logits)
    for pos, token in enumerate(tokens):
        logits.copy_(base_logits)  # a fresh logits row every step; the copy is not timed
        t0 = time.perf_counter_ns()
        matcher.fill()
        t1 = time.perf_counter_ns()
        matcher.apply(logits)
        t2 = time.perf_counter_ns()
        ok = matcher.accept(token)
        t3 = time.perf_counter_ns()
        if not ok:
            raise RuntimeError(f"token {pos} ({token}) rejected: {matcher.error()}")
        if not torch.isfinite(logits[0, token]):
            raise RuntimeError(f"token {pos} ({token}) of a valid answer was masked out")
        fill_us.append((t1 - t0) / 1e3)
        apply_us.append((t2 - t1) / 1e3)
        accept_us.append((t3 - t2) / 1e3)
    total = [a + b + c for a, b, c in zip(fill_us, apply_us, accept_us)]
    return {
        "n": len(tokens),
        "mean_us": statistics.fmean(total),
        "median_us": statistics.median(total),
        "max_us": max(total),
        "first_us": total[0],
        "fill_median_us": statistics.median(fill_us),
        "apply_median_us": statistics.median(apply_us),
        "accept_median_us": statistics.median(accept_us),
        "done": bool(matcher.done()),
    }


def random_run(matcher, vocab: int, eos: int | set[int], tokenizer, seed: int, max_steps: int) -> dict:
    """Masked argmax over random logits until the matcher stops; the text must be valid for the grammar."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    eos_ids = eos if isinstance(eos, set) else {eos}
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, vocab, generator=gen)
        matcher.fill()
        matcher.apply(logits)
        token = int(torch.argmax(logits, dim=-1))
        if not matcher.accept(token):
            return {"ok": False, "why": f"argmax token {token} rejected: {matcher.error()}", "tokens": len(out)}
        if token in eos_ids:
            break
        out.append(token)
        if matcher.done():  # llguidance stops by itself once nothing but EOS can follow
            break
    text = tokenizer.decode(out, skip_special_tokens=False)
    return {"terminated": bool(matcher.done()), "tokens": len(out), "text": text}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    vocab = len(tok)
    cfg = Path(path) / "config.json"
    if cfg.is_file():
        vocab = max(vocab, int(json.loads(cfg.read_text()).get("vocab_size", vocab)))
    return tok, vocab


def machine() -> dict:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", action="append", default=[], help="folder with tokenizer files (repeatable)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=200, help="length of the valid answer fed, in tokens (at least)")
    ap.add_argument("--out", required=True, help="results JSON (rewritten after each measurement)")
    ap.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated subset of xgrammar,llguidance")
    ap.add_argument("--grammars", default=",".join(GRAMMARS), help="comma-separated subset of rag_answer,json_object")
    ap.add_argument("--compile-threads", type=int, default=1, help="xgrammar GrammarCompiler max_threads")
    ap.add_argument("--check-steps", type=int, default=3000, help="step cap of the random-logits correctness run")
    ap.add_argument("--check-seeds", type=int, default=3, help="random-logits correctness runs per grammar")
    ap.add_argument(
        "--inductor-cache",
        default=None,
        help="TORCHINDUCTOR_CACHE_DIR (llguidance's apply is torch.compile'd); default: a fresh temporary "
        "folder, so the warm-up shows the cold compile a new process on a new machine pays",
    )
    ap.add_argument(
        "--generate",
        default=None,
        metavar="MODEL_DIR",
        help="also run model.generate() (greedy, in-process transformers) on this local model folder with "
        "each library's logits processor against no constraint: decode ms/token and the processor's share",
    )
    ap.add_argument("--generate-tokens", type=int, default=64, help="max_new_tokens of the --generate runs")
    args = ap.parse_args(argv)
    if not args.tokenizer and not args.generate:
        ap.error("give at least one --tokenizer (or --generate MODEL_DIR)")

    if "torch" not in sys.modules:
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.inductor_cache or tempfile.mkdtemp(prefix="cm-inductor-")
    import torch

    torch.set_num_threads(1)
    libraries = [name.strip() for name in args.libraries.split(",") if name.strip()]
    grammars = [name.strip() for name in args.grammars.split(",") if name.strip()]
    for name in libraries:
        _import(name)  # fail early with the install hint

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "benchmark": "constrained_mask",
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "versions": {name: _dist_version(name) for name in libraries},
        "repeats": args.repeats,
        "settings": {
            "whitespace": "compact: no free whitespace, separators ',' ':' (xgrammar any_whitespace=False, "
            "llguidance whitespace_flexible=False)",
            "xgrammar_compile_threads": args.compile_threads,
            "logits": "float32 [1, V], V = config vocab_size (logits width) when known",
            "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        },
        "schemas": GRAMMARS,
        "tokenizers": [],
        "measurements": [],
        "checks": [],
    }

    def save() -> None:
        results["updated_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2, ensure_ascii=False))
        tmp.replace(out_path)

    for tok_path in args.tokenizer:
        tokenizer, vocab = load_tokenizer(tok_path)
        label = Path(tok_path).name
        text = answer_text(tokenizer, args.tokens)
        answer_ids = tokenizer.encode(text, add_special_tokens=False)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise SystemExit(f"{tok_path}: the tokenizer has no EOS token")
        fed = answer_ids + [eos]
        tok_entry = {
            "path": tok_path,
            "label": label,
            "vocab": vocab,
            "tokenizer_len": len(tokenizer),
            "answer_tokens": len(answer_ids),
            "answer": text,
            "eos": eos,
            "setup_ms": {},
        }
        results["tokenizers"].append(tok_entry)
        print(f"[{label}] V={vocab} answer={len(answer_ids)} tokens", flush=True)

        backends = {}
        for name in libraries:
            backends[name] = BACKENDS[name](tokenizer, vocab, args.compile_threads)
            tok_entry["setup_ms"][name] = backends[name].setup_ms
            print(f"  {name}: tokenizer setup {backends[name].setup_ms:.0f} ms", flush=True)
        save()

        base_logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float32)

        # Warm-up, not timed: one full pass per library and grammar (llguidance's apply is torch.compile'd, and its
        # first call compiles it), reported separately.
        warm: dict = {}
        for name in libraries:
            for grammar in grammars:
                t0 = time.perf_counter()
                compiled, _, _ = backends[name].compile(grammar)
                feed(backends[name].matcher(compiled), fed, base_logits)
                warm[f"{name}/{grammar}"] = (time.perf_counter() - t0) * 1e3
        tok_entry["warmup_ms"] = warm
        print(f"  warm-up ms: { {k: round(v) for k, v in warm.items()} }", flush=True)
        save()

        for grammar in grammars:
            runs: dict[str, list[dict]] = {name: [] for name in libraries}
            for rep in range(args.repeats):
                order = libraries if rep % 2 == 0 else list(reversed(libraries))
                for name in order:
                    load_before = os.getloadavg()[0]
                    compiled, compile_ms, mem = backends[name].compile(grammar)
                    run = feed(backends[name].matcher(compiled), fed, base_logits)
                    run.update(compile_ms=compile_ms, memory_bytes=mem, load1=load_before)
                    runs[name].append(run)
                    # Save after each measurement.
                    results["measurements"] = [
                        m
                        for m in results["measurements"]
                        if not (m["tokenizer"] == label and m["grammar"] == grammar and m["library"] == name)
                    ]
                    results["measurements"].append(_aggregate(label, vocab, grammar, name, runs[name]))
                    save()
                    print(
                        f"  {grammar:11s} rep {rep} {name:10s} compile {compile_ms:8.1f} ms  "
                        f"mask+apply+accept {run['mean_us']:8.1f} us/token (median {run['median_us']:.1f}, "
                        f"max {run['max_us']:.0f})  load {load_before:.2f}",
                        flush=True,
                    )

        for name in libraries:
            for grammar in grammars:
                for seed in range(args.check_seeds):
                    compiled, _, _ = backends[name].compile(grammar)
                    res = random_run(backends[name].matcher(compiled), vocab, eos, tokenizer, seed, args.check_steps)
                    if "ok" not in res:
                        if res["terminated"]:
                            valid, how = validate(res["text"], grammar)
                            res.update(ok=valid, why=how)
                        else:
                            res.update(ok=None, why=f"did not stop within {args.check_steps} steps")
                    res["text"] = res.get("text", "")[:600]
                    res.update(tokenizer=label, library=name, grammar=grammar, seed=seed)
                    results["checks"].append(res)
                    save()
                    print(
                        f"  check {name:10s} {grammar:11s} seed {seed}: ok={res['ok']} ({res['why']}, "
                        f"{res['tokens']} tokens)",
                        flush=True,
                    )

    if args.generate:
        results["generate"] = []
        generate_runs(args, libraries, results, save)

    results["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    save()
    Path(str(out_path.with_suffix("")) + ".md").write_text(render_markdown(results))
    failed = [c for c in results["checks"] if c["ok"] is False]
    return 1 if failed else 0


class _TimedProcessor:
    """A transformers LogitsProcessor wrapper that adds up the time spent inside the wrapped processor."""

    def __init__(self, inner):
        self.inner = inner
        self.ns = 0
        self.calls = 0

    def __call__(self, input_ids, scores):
        t0 = time.perf_counter_ns()
        out = self.inner(input_ids, scores)
        self.ns += time.perf_counter_ns() - t0
        self.calls += 1
        return out


class LLGuidanceLogitsProcessor:
    """The few lines a transformers decode loop needs around llguidance (it ships no transformers processor)."""

    def __init__(self, llg_torch, matcher, vocab: int):
        self.t = llg_torch
        self.m = matcher
        self.bitmask = llg_torch.allocate_token_bitmask(1, vocab)
        self.started = False

    def __call__(self, input_ids, scores):
        if self.started and not self.m.is_stopped():
            if not self.m.consume_token(int(input_ids[0, -1])):
                raise RuntimeError(f"llguidance rejected a sampled token: {self.m.get_error()}")
        self.started = True
        self.t.fill_next_token_bitmask(self.m, self.bitmask, 0)
        self.t.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


def generate_runs(args, libraries: list[str], results: dict, save) -> None:
    """Greedy model.generate() with each library's processor (and none): decode ms/token and processor µs/token."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    tokenizer, vocab = load_tokenizer(args.generate)
    model = AutoModelForCausalLM.from_pretrained(args.generate, local_files_only=True, dtype=torch.float32).eval()
    backends = {name: BACKENDS[name](tokenizer, vocab, args.compile_threads) for name in libraries}
    question = "When was the Eiffel Tower completed, and who designed it?"
    context = " ".join(f"[{i + 1}] {sentence}" for i, sentence in enumerate(_SENTENCES))
    messages = [
        {
            "role": "user",
            "content": (
                f"Documents: {context}\n\nQuestion: {question}\nAnswer in JSON with keys answer (string), citations "
                "(document numbers) and confidence (0 to 1)."
            ),
        }
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    variants = ["none"] + libraries
    for rep in range(-1, args.repeats):  # rep -1: warm-up (llguidance's torch.compile), not recorded
        order = variants if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            processors = LogitsProcessorList()
            timed = None
            if name != "none":
                compiled, _, _ = backends[name].compile("rag_answer")
                if name == "xgrammar":
                    inner = backends[name].xgr.contrib.hf.LogitsProcessor(compiled)
                else:
                    inner = LLGuidanceLogitsProcessor(backends[name].llg_torch, compiled[1], vocab)
                timed = _TimedProcessor(inner)
                processors.append(timed)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    **prompt,
                    max_new_tokens=args.generate_tokens,
                    do_sample=False,
                    logits_processor=processors,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.eos_token_id,
                )
            seconds = time.perf_counter() - t0
            if rep < 0:
                continue
            new = out[0, prompt["input_ids"].shape[1] :].tolist()
            text = tokenizer.decode(new, skip_special_tokens=True)
            finished = bool(new) and new[-1] == tokenizer.eos_token_id
            valid, how = validate(text, "rag_answer") if finished else (None, "did not finish")
            record = {
                "library": name,
                "rep": rep,
                "new_tokens": len(new),
                "prompt_tokens": int(prompt["input_ids"].shape[1]),
                "ms_per_token": seconds * 1e3 / max(1, len(new)),
                "processor_us_per_token": (timed.ns / 1e3 / max(1, timed.calls)) if timed else 0.0,
                "finished": finished,
                "valid": valid if name != "none" else None,
                "why": how,
                "text": text[:400],
                "load1": os.getloadavg()[0],
            }
            results["generate"].append(record)
            save()
            print(
                f"  generate {name:10s} rep {rep}: {record['ms_per_token']:.1f} ms/token, processor "
                f"{record['processor_us_per_token']:.0f} us/token, {len(new)} tokens, valid={record['valid']}: "
                f"{text[:80]!r}",
                flush=True,
            )


def _aggregate(label: str, vocab: int, grammar: str, name: str, runs: list[dict]) -> dict:
    mems = [r["memory_bytes"] for r in runs if r["memory_bytes"] is not None]
    return {
        "tokenizer": label,
        "vocab": vocab,
        "grammar": grammar,
        "library": name,
        "runs": len(runs),
        "tokens_per_run": runs[0]["n"],
        "compile_ms": summary([r["compile_ms"] for r in runs]),
        "us_per_token": summary([r["mean_us"] for r in runs]),  # each run's total / n
        "us_per_token_median_step": summary([r["median_us"] for r in runs]),
        "worst_token_us": summary([r["max_us"] for r in runs]),
        "first_token_us": summary([r["first_us"] for r in runs]),
        "fill_us": summary([r["fill_median_us"] for r in runs]),
        "apply_us": summary([r["apply_median_us"] for r in runs]),
        "accept_us": summary([r["accept_median_us"] for r in runs]),
        "memory_bytes": statistics.median(mems) if mems else None,
        "load1": summary([r["load1"] for r in runs]),
        "all_done": all(r["done"] for r in runs),
        "raw": runs,
    }


def render_markdown(results: dict) -> str:
    def mm(s: dict, fmt: str = "{:.0f}") -> str:
        return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"

    lines = [
        "# Constrained-decoding mask cost (xgrammar vs llguidance)",
        "",
        f"{results['machine']['cpu']}, {results['machine']['cores']} cores, torch {results['torch']} "
        f"({results['torch_threads']} thread); versions: "
        + ", ".join(f"{k} {v}" for k, v in results["versions"].items())
        + f"; {results['repeats']} interleaved repeats; {results['settings']['whitespace']}.",
        "",
        "Per token = compute the next-token bitmask + apply it to float32 logits [1, V] + advance the matcher, "
        "at each of the n positions of a valid answer (+ EOS). `mask µs/token` is each run's median token, "
        "`mean µs/token` each run's total / n (includes the first token's lazy work and scheduler preemptions on a "
        "loaded machine); both as median (min-max) over the repeats. fill / apply / accept: medians of the parts.",
        "",
        "| library | tokenizer (vocab) | grammar | compile ms | mask µs/token | mean µs/token | fill µs | apply µs "
        "| accept µs | first token µs | grammar memory | n |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results["measurements"]:
        mem = f"{m['memory_bytes'] / 1024:.0f} KiB" if m["memory_bytes"] is not None else "not reported"
        lines.append(
            f"| {m['library']} | {m['tokenizer']} ({m['vocab']}) | {m['grammar']} | {mm(m['compile_ms'], '{:.1f}')} "
            f"| {mm(m['us_per_token_median_step'])} | {mm(m['us_per_token'])} | {m['fill_us']['median']:.0f} "
            f"| {m['apply_us']['median']:.0f} | {m['accept_us']['median']:.0f} | {m['first_token_us']['median']:.0f} "
            f"| {mem} "
            f"| {m['tokens_per_run']} × {m['runs']} |"
        )
    lines += ["", "Tokenizer setup (one-off per process, ms): "]
    for t in results["tokenizers"]:
        lines.append(
            f"- {t['label']} (V={t['vocab']}): "
            + ", ".join(f"{k} {v:.0f}" for k, v in t["setup_ms"].items())
            + "; first full pass incl. compile (warm-up): "
            + ", ".join(f"{k} {v:.0f}" for k, v in t.get("warmup_ms", {}).items())
        )
    if results.get("generate"):
        lines += [
            "",
            "In a transformers decode loop (greedy `model.generate`, rag_answer schema; "
            "median (min-max) over the repeats):",
            "",
            "| processor | decode ms/token | processor µs/token | share of the step | new tokens | valid JSON |",
            "|---|---|---|---|---|---|",
        ]
        names = list(dict.fromkeys(g["library"] for g in results["generate"]))
        for name in names:
            gs = [g for g in results["generate"] if g["library"] == name]
            ms = summary([g["ms_per_token"] for g in gs])
            us = summary([g["processor_us_per_token"] for g in gs])
            share = statistics.median(g["processor_us_per_token"] / 1e3 / g["ms_per_token"] for g in gs)
            valid = "-" if name == "none" else f"{sum(bool(g['valid']) for g in gs)}/{len(gs)}"
            lines.append(
                f"| {name} | {mm(ms, '{:.1f}')} | {mm(us)} | {share:.1%} | "
                f"{statistics.median(g['new_tokens'] for g in gs):.0f} | {valid} |"
            )
    lines += ["", "Correctness (masked argmax of random logits, parsed and validated):", ""]
    for c in results["checks"]:
        lines.append(
            f"- {c['library']} / {c['tokenizer']} / {c['grammar']} / seed {c['seed']}: ok={c['ok']} "
            f"({c['why']}, {c['tokens']} tokens)"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
