"""Gateway load benchmark (issue 12): requests/s and p50/p99 TTFT at 1, 8 and 64 concurrent streams,
batched against unbatched draft scoring, the gateway's overhead against the in-process engine, and
resident memory over many sequential requests.

The gateway runs as ``specprefill-rag serve`` in a subprocess (its RSS is read with psutil), with the
main model in-process on the same machine (the embedded SmolLM2-135M by default: draft and main);
the clients are httpx streams in this process. Each request carries different documents.

    python benchmarks/serve_load.py            # full run, writes benchmarks/results/serve-load/run.json
    python benchmarks/serve_load.py --quick    # a smoke run, not a measurement: benchmarks/results/smoke/serve-load/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted((ROOT / "examples" / "documents").glob("*.txt"))
QUESTION = "In what year did the Brooklyn Bridge open to traffic?"
PHASES = ("batching", "load", "overhead", "rss")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--main", default="smollm2-135m")
    parser.add_argument("--draft", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64], help="concurrent streams per level")
    parser.add_argument("--requests", type=int, default=64, help="requests per level (at least the streams)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4], help="--draft-batch-size values compared")
    parser.add_argument("--words", type=int, default=150, help="words per document (3 documents a request)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--overhead-requests", type=int, default=20)
    parser.add_argument("--rss-requests", type=int, default=1000)
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/serve-load/run.json (--quick: smoke/)")
    parser.add_argument("--quick", action="store_true", help="1 and 4 streams, 8 requests, 30 for RSS")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="main and draft = a tiny random Llama saved to a temporary folder: the model work is "
        "near zero, so what is left is the gateway's own cost (answers are meaningless)",
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        choices=PHASES,
        default=list(PHASES),
        help="what to measure (default: all); 'overhead' and 'rss' use the last --batch-sizes value",
    )
    parser.add_argument(
        "--draft-only", action="store_true", help="only the draft batching comparison (--phases batching)"
    )
    parser.add_argument(
        "--draft-cache-mb", type=int, default=None, help="the gateway's --draft-cache-mb (default: serve's default)"
    )
    parser.add_argument(
        "--draft-prompts", type=int, default=0, help="prompts in the batching comparison (2 x largest batch)"
    )
    args = parser.parse_args(argv)
    if args.draft_only:
        args.phases = ["batching"]
    if args.tiny:
        args.main = args.draft = tiny_model_folder()
    if args.quick:
        args.streams, args.requests, args.overhead_requests, args.rss_requests = [1, 4], 8, 4, 30
    if args.out is None:  # a --quick run is a smoke run, kept apart from the results
        run = Path("smoke", "serve-load", "quick.json") if args.quick else Path("serve-load", "run.json")
        args.out = ROOT / "benchmarks" / "results" / run
    return args


def tiny_model_folder() -> str:
    """The test suite's tiny random Llama (2 layers, hidden 64) and tokenizer, saved as a model folder."""
    import tempfile

    from specprefill_rag.testing import build_model, build_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="specprefill-tiny-"))
    tokenizer = build_tokenizer()
    build_model(tokenizer, max_positions=4096).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def documents_for(index: int, words: int) -> list[str]:
    """Three documents, different for every request (a window of each file that moves with ``index``)."""
    texts = [path.read_text().split() for path in DOCUMENTS]
    picked = [texts[(index + k) % len(texts)] for k in range(3)]
    return [" ".join(t[(index * 7) % max(1, len(t) - words) :][:words]) for t in picked]


def body(index: int, args: argparse.Namespace, stream: bool) -> dict:
    return {
        "model": args.main,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": stream,
        "spec_prefill": {"documents": documents_for(index, args.words)},
    }


def start_gateway(
    args: argparse.Namespace, batch_size: int, draft_cache_mb: int | None
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "specprefill_rag.cli",
        "serve",
        "--main",
        args.main,
        "--draft",
        args.draft,
        "--device",
        args.device,
        "--port",
        str(port),
        "--draft-batch-size",
        str(batch_size),
        "--min-prompt-tokens",
        "0",
        "--queue-size",
        "4096",
        "--log-level",
        "warning",
    ]
    if draft_cache_mb is not None:
        command += ["--draft-cache-mb", str(draft_cache_mb)]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.terminate()
    raise RuntimeError("the gateway did not start within 600 s")


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]


async def timed_stream(client: httpx.AsyncClient, url: str, payload: dict) -> float:
    """Seconds from sending to the first content chunk of one streamed request."""
    started = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=payload) as response:
        response.raise_for_status()
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - started
    return first if first is not None else time.perf_counter() - started


async def load_level(url: str, args: argparse.Namespace, streams: int, offset: int) -> dict:
    """``args.requests`` streamed requests, at most ``streams`` at a time."""
    gate = asyncio.Semaphore(streams)
    count = max(args.requests, streams)

    async def one(client: httpx.AsyncClient, index: int) -> float:
        async with gate:
            return await timed_stream(client, url, body(offset + index, args, stream=True))

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        ttfts = await asyncio.gather(*(one(client, i) for i in range(count)))
        elapsed = time.perf_counter() - started
    return {
        "streams": streams,
        "requests": count,
        "requests_per_s": count / elapsed,
        "ttft_p50_ms": 1000 * percentile(ttfts, 0.5),
        "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
    }


def overhead(url: str, args: argparse.Namespace) -> dict:
    """The gateway's time per request beyond the same work in-process, blocking (``generate_layout``) and
    on an event loop (``agenerate_layout``, the path the gateway takes): sequential non-streamed requests,
    the three interleaved; the engine is built here with the gateway's settings."""
    from specprefill_rag import GenerationParams, SpecPrefillEngine
    from specprefill_rag.prompt.chat import ChatMessage, chat_layout

    # No draft prefix cache on either side (run_gateway starts this gateway with --draft-cache-mb 0): the async
    # call repeats the blocking call's prompt and would start from its cached KV, and the cache's own cost is
    # the engine's, the same in-process and behind the gateway.
    engine = SpecPrefillEngine(
        main=args.main, draft=args.draft, device=args.device, min_prompt_tokens=0, draft_cache_mb=0
    )
    params = GenerationParams(max_new_tokens=args.max_tokens)
    times: dict[str, list[float]] = {"gateway": [], "engine": [], "engine_async": []}

    def layout(payload: dict):
        documents = payload["spec_prefill"]["documents"]
        return chat_layout(engine.tokenizer, [ChatMessage("user", [QUESTION])], documents).layout

    def timed(name: str, work, keep: bool) -> None:
        started = time.perf_counter()
        work()
        if keep:
            times[name].append((time.perf_counter() - started) * 1000)

    with httpx.Client(timeout=600) as client:
        for index in range(args.overhead_requests + 1):  # the first round is a warm-up
            payload = body(10_000 + index, args, stream=False)
            timed(
                "gateway",
                lambda p=payload: client.post(url + "/v1/chat/completions", json=p).raise_for_status(),
                index > 0,
            )
            timed("engine", lambda p=payload: engine.generate_layout(layout(p), params), index > 0)
            timed("engine_async", lambda p=payload: asyncio.run(engine.agenerate_layout(layout(p), params)), index > 0)
    result = {"requests": args.overhead_requests}
    for name, values in times.items():
        result[f"{name}_ms_median"] = statistics.median(values)
    for name in ("engine", "engine_async"):
        differences = [g - e for g, e in zip(times["gateway"], times[name])]
        result[f"overhead_vs_{name}_ms"] = {
            "median": statistics.median(differences),
            "min": min(differences),
            "max": max(differences),
        }
    return result


def gauge(client: httpx.Client, url: str, name: str) -> float:
    """One unlabelled gauge's value from the gateway's ``/metrics``."""
    for line in client.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise RuntimeError(f"/metrics has no {name}")


def resident_memory(url: str, pid: int, args: argparse.Namespace) -> dict:
    """The gateway process's RSS, sampled ten times over ``args.rss_requests`` sequential requests."""
    import psutil

    process, samples = psutil.Process(pid), []
    every = max(1, args.rss_requests // 10)
    with httpx.Client(timeout=600) as client:
        for index in range(args.rss_requests):
            client.post(url + "/v1/chat/completions", json=body(20_000 + index, args, stream=False)).raise_for_status()
            if index % every == 0 or index == args.rss_requests - 1:
                cache_mb = gauge(client, url, "specprefill_draft_cache_bytes") / 2**20
                samples.append(
                    {
                        "after_requests": index + 1,
                        "rss_mb": process.memory_info().rss / 2**20,
                        "draft_cache_mb": cache_mb,
                    }
                )
    return {
        "requests": args.rss_requests,
        "samples": samples,
        "growth_mb_after_first_tenth": samples[-1]["rss_mb"] - samples[1 if len(samples) > 1 else 0]["rss_mb"],
    }


def draft_batching(args: argparse.Namespace) -> list[dict]:
    """Draft scoring alone, in this process: ms per prompt when ``2 x max(batch sizes)`` different prompts
    are scored in batches of each size (interleaved, 3 repeats, median and min-max)."""
    import torch

    from specprefill_rag.backends.hf import eos_token_ids
    from specprefill_rag.draft.model import ModelDraft
    from specprefill_rag.models.loading import shared_model
    from specprefill_rag.prompt.chat import ChatMessage, chat_layout

    loaded = shared_model(args.draft, args.device)
    draft = ModelDraft(loaded.model, 8, 13, eos_token_ids(loaded.model, loaded.tokenizer))
    count = args.draft_prompts or 2 * max(args.batch_sizes)
    prompts = [
        chat_layout(
            loaded.tokenizer, [ChatMessage("user", [QUESTION])], documents_for(i, args.words)
        ).layout.input_ids.to(args.device)
        for i in range(count)
    ]
    times: dict[int, list[float]] = {size: [] for size in args.batch_sizes}
    draft.score_batch(prompts[:1])  # warm-up
    for repeat in range(3):
        for size in args.batch_sizes:
            started = time.perf_counter()
            for first in range(0, count, size):
                draft.score_batch(prompts[first : first + size])
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[size].append((time.perf_counter() - started) * 1000 / count)
            print(f"  repeat {repeat}: batch {size}: {times[size][-1]:.0f} ms per prompt", flush=True)
    tokens = statistics.mean(p.numel() for p in prompts)
    return [
        {
            "batch_size": size,
            "prompts": count,
            "mean_prompt_tokens": tokens,
            "ms_per_prompt_median": statistics.median(t),
            "ms_per_prompt_min": min(t),
            "ms_per_prompt_max": max(t),
        }
        for size, t in times.items()
    ]


def run_gateway(args: argparse.Namespace, batch_size: int, measure_extras: bool) -> dict:
    result: dict = {"draft_batch_size": batch_size}
    with gateway_process(args, batch_size, args.draft_cache_mb) as (process, url):
        if "load" in args.phases:
            result["levels"] = [
                asyncio.run(load_level(url, args, streams, offset=1000 * streams)) for streams in args.streams
            ]
        if measure_extras and "rss" in args.phases:
            result["rss"] = resident_memory(url, process.pid, args)
    if measure_extras and "overhead" in args.phases:
        with gateway_process(args, batch_size, 0) as (_, url):  # see overhead(): no draft cache on either side
            result["overhead"] = overhead(url, args)
    return result


@contextlib.contextmanager
def gateway_process(args: argparse.Namespace, batch_size: int, draft_cache_mb: int | None):
    """A started, warmed-up gateway: ``(process, url)``; terminated on exit."""
    process, url = start_gateway(args, batch_size, draft_cache_mb)
    try:
        asyncio.run(load_level(url, args, 1, offset=90_000))  # warm-up
        yield process, url
    finally:
        process.terminate()
        process.wait(timeout=60)


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine_before": machine(),
        "runs": [],
    }
    if "batching" in args.phases:
        report["draft_batching"] = draft_batching(args)
        for row in report["draft_batching"]:
            print(
                f"draft batch {row['batch_size']}: {row['ms_per_prompt_median']:.0f} ms per prompt "
                f"({row['ms_per_prompt_min']:.0f}-{row['ms_per_prompt_max']:.0f}), "
                f"{row['mean_prompt_tokens']:.0f} tokens"
            )
    sizes = args.batch_sizes if "load" in args.phases else args.batch_sizes[-1:]
    if {"load", "overhead", "rss"} & set(args.phases):
        for position, batch_size in enumerate(sizes):
            report["runs"].append(run_gateway(args, batch_size, measure_extras=position == len(sizes) - 1))
    report["machine_after"] = machine()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print_summary(report["runs"])
    print(f"wrote {args.out}")


def print_summary(runs: list[dict]) -> None:
    for run in runs:
        for level in run.get("levels", []):
            print(
                f"batch {run['draft_batch_size']}: {level['streams']:>3} streams  {level['requests_per_s']:.2f} "
                f"req/s  TTFT p50 {level['ttft_p50_ms']:.0f} ms  p99 {level['ttft_p99_ms']:.0f} ms"
            )
    extras = runs[-1] if runs else {}
    if "overhead" in extras:
        cost = extras["overhead"]
        print(
            f"overhead per request: {cost['overhead_vs_engine_ms']['median']:.1f} ms against the blocking engine, "
            f"{cost['overhead_vs_engine_async_ms']['median']:.1f} ms against its async path (gateway "
            f"{cost['gateway_ms_median']:.0f} ms, engine {cost['engine_ms_median']:.0f} / "
            f"{cost['engine_async_ms_median']:.0f} ms)"
        )
    if "rss" in extras:
        samples = extras["rss"]["samples"]
        print(
            f"RSS: {[round(s['rss_mb']) for s in samples]} MB; draft cache "
            f"{[round(s['draft_cache_mb']) for s in samples]} MB"
        )


if __name__ == "__main__":
    main()
