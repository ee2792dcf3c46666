"""Core-engine speed benchmark: draft scoring cost, sparse-prefill scaling and TTFT vs the bound.

All methods run side by side in one process, interleaved per repeat; medians and min-max spread are
reported. Peak memory of scoring vs a plain draft prefill is measured in fresh subprocesses (CPU:
peak RSS growth; CUDA: max allocated).

CPU (default): draft = real SmolLM2-135M-Instruct; main = a random model of SmolLM2-1.7B's shape
(prefill time does not depend on weight values). With CUDA present, ``--device cuda`` uses
Llama-3.1-8B / Llama-3.2-1B shapes in bf16 at 8k and 32k tokens.

    python benchmarks/ttft.py            # full run, writes benchmarks/results/ttft/<device>.json
    python benchmarks/ttft.py --quick    # 2k tokens, 1 repeat: benchmarks/results/smoke/ttft/<device>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.config import GenerationParams
from specprefill_rag.draft.model import ModelDraft
from specprefill_rag.models.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
ESSAYS = ROOT.parent / "shared" / "data" / "niah_paul_graham"
SHAPES = {
    "smollm2-1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=130000.0,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}


def shape_model(shape: str, dtype: torch.dtype, device: str):
    """A randomly initialised Llama of a real model's shape, for timing only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):  # built in ``dtype`` directly: no float32 copy of 8B weights; RoPE stays float32
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def prompt_ids(tokenizer, length: int, vocab_size: int) -> torch.Tensor:
    """Real text when the essays are present (random ids otherwise), cut to ``length`` tokens."""
    if ESSAYS.is_dir() and tokenizer is not None:
        text = "\n\n".join(p.read_text() for p in sorted(ESSAYS.glob("*.txt")) if "LICENSE" not in p.name)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        return torch.tensor(ids[:length])
    return torch.randint(vocab_size, (length,), generator=torch.Generator().manual_seed(0))


def as_layout_indices(length: int) -> torch.Tensor:
    """Document index for a synthetic RAG prompt: 32 template tokens, documents of 512, 64-token question."""
    index = torch.full((length,), -1)
    body = torch.arange(32, length - 64)
    index[body] = (body - 32) // 512
    return index


def clock(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000.0


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


@torch.inference_mode()
def plain_prefill(model, ids: torch.Tensor) -> None:
    from transformers import DynamicCache

    model(
        input_ids=ids[None],
        position_ids=torch.arange(ids.numel(), device=ids.device)[None],
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=1,
    )


def first_token(backend, prompt: SparsePrompt) -> None:
    next(iter(backend.generate(prompt, GenerationParams(max_new_tokens=1))))


def load_draft(args):
    """``(draft model, tokenizer)``: the real SmolLM2-135M on CPU; on CUDA a Llama-3.2-1B shape and no tokenizer."""
    if args.device == "cpu":
        draft = load_model("smollm2-135m", "cpu")
        return draft.model, draft.tokenizer
    return shape_model("llama-3.2-1b", torch.bfloat16, args.device), None


def load_pair(args):
    draft_model, tokenizer = load_draft(args)
    if args.device == "cpu":
        return draft_model, tokenizer, shape_model(args.main_shape, torch.float32, "cpu")
    return draft_model, tokenizer, shape_model("llama-3.1-8b", torch.bfloat16, args.device)


def timing_engine(main_model, tokenizer, draft_model):
    """What :func:`run_length` times: an engine, or only a main backend for the GPU shapes (random ids, no
    tokenizer)."""
    if tokenizer is not None:
        # main_cache_mb=0: every repeat prefills (the main prefix cache would serve repeats 2+ from repeat 1's KV)
        return SpecPrefillEngine.from_models(main_model, tokenizer, draft_model, min_prompt_tokens=0, main_cache_mb=0)
    from specprefill_rag.backends.hf import HFBackend

    return argparse.Namespace(backend=HFBackend(main_model, frozenset()))


def run_length(engine, draft_model, tokenizer, length: int, args) -> dict:
    device = args.device
    ids = prompt_ids(tokenizer, length, draft_model.config.vocab_size).to(device)
    index = as_layout_indices(length)
    scorer = ModelDraft(draft_model, look_ahead=args.look_ahead, pool_kernel=13)
    importance = scorer.score(ids).cpu()  # warm-up, and the selection used below
    from specprefill_rag.selection import select_kept

    kept = select_kept(importance, index, keep_rate=args.keep_rate, chunk_size=32).to(device)
    samples: dict[str, list[float]] = {
        k: [] for k in ("draft_prefill", "draft_scoring", "main_full", "main_sparse", "specprefill_ttft")
    }
    # Warm-up; on CUDA at full length, so the caching allocator's growth is not in the first repeat.
    first_token(engine.backend, SparsePrompt.full(ids if device.startswith("cuda") else ids[:256]))
    for _ in range(args.repeats):
        samples["draft_prefill"].append(clock(lambda: plain_prefill(draft_model, ids), device))
        samples["draft_scoring"].append(clock(lambda: scorer.score(ids), device))
        samples["main_full"].append(clock(lambda: first_token(engine.backend, SparsePrompt.full(ids)), device))
        samples["main_sparse"].append(clock(lambda: first_token(engine.backend, SparsePrompt.kept(ids, kept)), device))

        def specprefill() -> None:
            scores = scorer.score(ids).cpu()
            chosen = select_kept(scores, index, keep_rate=args.keep_rate, chunk_size=32).to(device)
            first_token(engine.backend, SparsePrompt.kept(ids, chosen))

        samples["specprefill_ttft"].append(clock(specprefill, device))
    stats = {k: summary(v) for k, v in samples.items()}
    med = {k: v["median"] for k, v in stats.items()}
    keep_actual = kept.numel() / length
    bound = 1.0 / (keep_actual + med["draft_scoring"] / med["main_full"])
    speedup = med["main_full"] / med["specprefill_ttft"]
    return {
        "prompt_tokens": length,
        "kept_tokens": int(kept.numel()),
        "kept_share": keep_actual,
        "timings_ms": stats,
        "scoring_over_plain_draft_prefill": med["draft_scoring"] / med["draft_prefill"],
        "sparse_over_full_prefill": med["main_sparse"] / med["main_full"],
        "ttft_speedup": speedup,
        "bound": bound,
        "speedup_over_bound": speedup / bound,
    }


def memory_probe(args) -> None:
    """Child process: print peak memory growth (MB) of one plain draft prefill or one scoring call."""
    draft_model, tokenizer = load_draft(args)
    ids = prompt_ids(tokenizer, args.lengths[0], draft_model.config.vocab_size).to(args.device)
    run = (
        (lambda: plain_prefill(draft_model, ids))
        if args.probe == "prefill"
        else (lambda: ModelDraft(draft_model, look_ahead=args.look_ahead).score(ids))
    )
    if args.device.startswith("cuda"):
        plain_prefill(draft_model, ids[:16])  # cuBLAS workspaces would otherwise count in the first probe's peak
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        print(json.dumps({"peak_mb": (torch.cuda.max_memory_allocated() - base) / 2**20}))
        return
    print(json.dumps({"peak_mb": peak_rss_growth_mb(run)}))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss_growth_mb(run) -> float:
    """Peak resident-memory growth while ``run`` executes, sampled every millisecond by a thread."""
    import threading

    base, peak, done = _rss_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    return (max(peak[0], _rss_bytes()) - base) / 2**20


def measure_memory(args, length: int) -> dict:
    """Median over ``max(repeats, 3)`` fresh processes per probe (CPU RSS sampling is noisy)."""
    samples: dict[str, list[float]] = {"prefill": [], "scoring": []}
    for _ in range(max(args.repeats, 3)):
        for probe in samples:
            command = [
                sys.executable,
                __file__,
                "--probe",
                probe,
                "--device",
                args.device,
                "--lengths",
                str(length),
                "--look-ahead",
                str(args.look_ahead),
            ]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            samples[probe].append(json.loads(out)["peak_mb"])
    result: dict = {probe: summary(values) for probe, values in samples.items()}
    result["scoring_over_prefill"] = result["scoring"]["median"] / result["prefill"]["median"]
    return result


def cpu_model() -> str:
    """The CPU's model name and its bfloat16 instructions (AMX, AVX512-BF16), which set the dtype's speed."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
        platform.machine(),
    )
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    bf16 = [label for flag, label in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    return f"{name} ({', '.join(bf16) or 'no bfloat16 instructions'})"


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import os

    cores = f"{os.cpu_count()} CPU threads ({torch.get_num_threads()} used by torch)"
    return f"{cpu_model()}, {cores}, torch {torch.__version__}"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    options.add_argument("--lengths", type=int, nargs="+")
    options.add_argument("--repeats", type=int, default=3)
    options.add_argument("--keep-rate", type=float, default=0.1)
    options.add_argument("--look-ahead", type=int, default=8)
    options.add_argument("--main-shape", default="smollm2-1.7b", choices=sorted(SHAPES))
    options.add_argument("--quick", action="store_true", help="2k tokens, one repeat")
    options.add_argument("--probe", choices=["prefill", "scoring"], help=argparse.SUPPRESS)
    options.add_argument("--out", type=Path)
    args = options.parse_args()
    if args.lengths is None:
        args.lengths = [2048] if args.quick else ([4096] if args.device == "cpu" else [8192, 32768])
    if args.quick:
        args.repeats = 1
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)  # synchronize() and the memory counters act on the current device
    if args.probe:
        memory_probe(args)
        return
    draft_model, tokenizer, main_model = load_pair(args)
    engine = timing_engine(main_model, tokenizer, draft_model)
    report = {
        "machine": machine(),
        "device": args.device,
        "repeats": args.repeats,
        "keep_rate": args.keep_rate,
        "look_ahead": args.look_ahead,
        "results": [],
    }
    for length in args.lengths:
        row = run_length(engine, draft_model, tokenizer, length, args)
        print(json.dumps(row, indent=2), flush=True)
        row["peak_memory_mb"] = measure_memory(args, length)
        report["results"].append(row)
        print(json.dumps(row["peak_memory_mb"]), flush=True)
    results = ROOT / "benchmarks" / "results"  # a --quick run is a smoke run, kept apart from the results
    out = args.out or (results / "smoke" if args.quick else results) / "ttft" / f"{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
