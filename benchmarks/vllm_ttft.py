"""vLLM main-model benchmark: TTFT of a compressed request vs the full prompt, decode speed and QPS.

Runs in the environment that has vLLM and this package's plugin (`make install-vllm`, then
`.venv-vllm/bin/python benchmarks/vllm_ttft.py`). Main model: the embedded SmolLM2-135M-Instruct.
Draft excluded: this measures what the server does with the kept tokens. Prefix caching is off so
that repeats do not hit the cache; requests are interleaved (full, sparse, plain-decode,
sparse-decode) and repeated. QPS: ``--qps-requests`` requests submitted at once, full vs compressed,
each generating ``--decode-tokens`` tokens; requests per second of the whole batch.

On a GPU: ``--model <HF folder> --dtype auto --gpu-memory-utilization 0.8`` (plus any vLLM engine
argument through ``--tensor-parallel-size``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from vllm import LLM, SamplingParams

    from specprefill_rag.backends.base import SparsePrompt
    from specprefill_rag.backends.vllm import request_fields
    from specprefill_rag.models.loading import embedded_gguf, gguf_folder
    from specprefill_rag.selection import select_kept

    options = argparse.ArgumentParser(description=__doc__)
    options.add_argument("--length", type=int, default=4096)
    options.add_argument("--keep-rate", type=float, default=0.1)
    options.add_argument("--repeats", type=int, default=5)
    options.add_argument("--decode-tokens", type=int, default=64)
    options.add_argument("--qps-requests", type=int, default=8, help="batch size of the QPS study; 0 skips it")
    options.add_argument("--model", help="main model folder or HF id; default the embedded SmolLM2-135M")
    options.add_argument("--dtype", default="float32")
    options.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    options.add_argument("--tensor-parallel-size", type=int, default=1)
    options.add_argument("--out", type=Path)
    args = options.parse_args()

    llm = LLM(
        model=args.model or str(gguf_folder(embedded_gguf("smollm2-135m"))),
        max_model_len=8192,
        dtype=args.dtype,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (args.length,), generator=generator)
    document_index = torch.full((args.length,), -1)
    document_index[32 : args.length - 64] = torch.arange(args.length - 96) // 512
    kept = select_kept(
        torch.rand(args.length, generator=generator), document_index, keep_rate=args.keep_rate, chunk_size=32
    )

    def timed(prompt: SparsePrompt, max_tokens: int, copies: int = 1) -> float:
        fields = request_fields(prompt)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            ignore_eos=True,
            detokenize=False,
            extra_args=fields.pop("extra_args", None),
        )
        started = time.perf_counter()
        llm.generate([fields] * copies, params, use_tqdm=False)
        return (time.perf_counter() - started) * 1000

    # plain: the same kept tokens as an ordinary request (contiguous positions, no plugin work), which
    # isolates what the position remap costs during decoding
    full, sparse = SparsePrompt.full(ids), SparsePrompt.kept(ids, kept)
    plain = SparsePrompt.full(ids[kept])
    prompts = {"full": full, "sparse": sparse, "plain": plain}
    for prompt in prompts.values():
        timed(prompt, 1)  # warm-up
    samples: dict[str, list[float]] = {f"{name}_{kind}": [] for name in prompts for kind in ("ttft", "decode")}
    for _ in range(args.repeats):
        for name, prompt in prompts.items():
            samples[f"{name}_ttft"].append(timed(prompt, 1))
            samples[f"{name}_decode"].append(timed(prompt, args.decode_tokens))
    if args.qps_requests:
        for name in ("full", "sparse"):
            samples[f"{name}_batch"] = [
                timed(prompts[name], args.decode_tokens, args.qps_requests) for _ in range(args.repeats)
            ]
    med = {k: statistics.median(v) for k, v in samples.items()}
    tps = {name: (args.decode_tokens - 1) / ((med[f"{name}_decode"] - med[f"{name}_ttft"]) / 1000) for name in prompts}
    qps = {name: args.qps_requests / (med[f"{name}_batch"] / 1000) for name in ("full", "sparse") if args.qps_requests}
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    report = {
        "machine": f"{device}, vllm {__import__('vllm').__version__}",
        "qps_requests": args.qps_requests,
        "qps": qps,
        "prompt_tokens": args.length,
        "kept_tokens": int(kept.numel()),
        "repeats": args.repeats,
        "samples_ms": samples,
        "medians_ms": med,
        "sparse_over_full_ttft": med["sparse_ttft"] / med["full_ttft"],
        "spread_ms": {k: [min(v), max(v)] for k, v in samples.items()},
        "decode_tokens_per_s": {**tps, "sparse_over_plain": tps["sparse"] / tps["plain"]},
    }
    run = "gpu" if torch.cuda.is_available() else "cpu"
    out = args.out or ROOT / "benchmarks" / "results" / "vllm-ttft" / f"{run}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "samples_ms"}, indent=2))


if __name__ == "__main__":
    main()
