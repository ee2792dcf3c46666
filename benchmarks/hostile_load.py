"""A normal request's latency while 6 clients send one kind of heavy request (issue #43), before and after.

For each kind in ``--kinds`` a fresh gateway (``specprefill-rag serve`` on 127.0.0.1 only, the embedded SmolLM2-135M
as main and draft by default) is started; a probe process sends a normal 2-token chat request every
``--probe-interval-s`` while ``--clients`` client threads send that kind of request one after another for
``--window-s`` seconds (each request bounded by ``--timeout-s``; the loops stop by themselves), and the
probe's latencies are summarised (median, p90, max) with the heavy clients' statuses. Kinds:

* ``none``: the probe alone (the baseline);
* ``pattern``: ``response_format`` with ``{"type": "string", "pattern": "^[a-z]{N}$"}`` (``--pattern-repeat``);
* ``anyof``: a ``response_format`` schema of ``--anyof-bytes`` bytes, one ``anyOf`` of small objects;
* ``warm``: the warm-up endpoint with ``--warm-documents`` documents of ``--warm-words`` words each;
* ``tools``: ``--tools-bytes`` of tool definitions (``tool_choice`` auto);
* ``slow``: bodies that arrive one byte every ``--slow-byte-s`` seconds (each client one connection at a time).

Results go to ``benchmarks/results/hostile-load/<label>.json`` (rewritten after every row), with the machine
(CPU, cores, load averages) and the code served. ``--pythonpath`` serves an older checkout with the same script:

    python benchmarks/hostile_load.py --label after
    python benchmarks/hostile_load.py --pythonpath /tmp/old-checkout --label before
    python benchmarks/hostile_load.py --kinds none pattern --clients 1 --window-s 3 --label smoke  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from serve_hostile import HOST, Probe, Server, Tally, machine, outcome, served_code, spread, word_text

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("none", "pattern", "anyof", "warm", "tools", "slow")
CHAT = "/v1/chat/completions"
WARM = "/v1/spec_prefill/documents/warm"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="run", help="writes benchmarks/results/hostile-load/<label>.json")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results" / "hostile-load")
    parser.add_argument("--pythonpath", type=Path, help="serve the package from this checkout (PYTHONPATH)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--clients", type=int, default=6, help="heavy clients at once")
    parser.add_argument("--window-s", type=float, default=60.0, help="heavy clients start requests this long")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="httpx timeout of every request")
    parser.add_argument("--probe-interval-s", type=float, default=1.0)
    parser.add_argument("--pattern-repeat", type=int, default=40000)
    parser.add_argument("--anyof-bytes", type=int, default=1_000_000)
    parser.add_argument("--tools-bytes", type=int, default=1 << 20)
    parser.add_argument("--warm-documents", type=int, default=8)
    parser.add_argument("--warm-words", type=int, default=300)
    parser.add_argument("--slow-byte-s", type=float, default=1.0)
    parser.add_argument("--model", default="smollm2-135m", help="--main and --draft of the gateway")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=["--max-body-bytes", str(4 << 20)],  # the 1 MB schemas and tool lists are read, not refused as 413s
        metavar="ARG",
        help="extra argument for `serve` (repeat: --serve-arg=--request-timeout --serve-arg=20)",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--sample-ms", type=float, default=200.0, help="RSS sampling period of the server")
    parser.add_argument("--rss-limit-gb", type=float, default=12.0, help="watchdog: kill the server above this RSS")
    parser.add_argument("--min-available-gb", type=float, default=2.0, help="watchdog: the machine's free memory")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the heavy requests


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Give the answer."}], "max_tokens": 4, **fields}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def anyof_schema(size: int) -> dict[str, Any]:
    """One ``anyOf`` of objects with one required string property each, about ``size`` bytes of JSON."""
    branches, used = [], 0
    while used < size:
        index = len(branches)
        key = f"field_{index}"
        branch = {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}
        branches.append(branch)
        used += len(json.dumps(branch)) + 2
    return {"anyOf": branches}


def tool_list(size: int) -> list[dict[str, Any]]:
    """Distinct tools with a few string parameters, about ``size`` bytes of JSON."""
    tools, used = [], 0
    while used < size:
        index = len(tools)
        properties = {f"p{k}": {"type": "string", "description": f"parameter {k} of tool {index}"} for k in range(4)}
        parameters = {"type": "object", "properties": properties}
        function = {"name": f"tool_{index}", "description": f"tool number {index}", "parameters": parameters}
        tool = {"type": "function", "function": function}
        tools.append(tool)
        used += len(json.dumps(tool)) + 2
    return tools


def heavy_request(kind: str, args: argparse.Namespace) -> Callable[[httpx.Client, str, int], httpx.Response]:
    """One request of ``kind``: ``(client, url, number) -> response``; each differs (no cache serves a repeat)."""
    model = args.model
    if kind == "pattern":

        def pattern(client: httpx.Client, url: str, n: int) -> httpx.Response:
            schema = {"type": "string", "pattern": f"^[a-z]{{{args.pattern_repeat}}}$", "description": f"request {n}"}
            return client.post(url + CHAT, json=chat(model, response_format=schema_format(schema)))

        return pattern
    if kind == "anyof":
        schema = anyof_schema(args.anyof_bytes)
        return lambda client, url, n: client.post(
            url + CHAT, json=chat(model, response_format=schema_format({**schema, "description": f"request {n}"}))
        )
    if kind == "tools":
        tools = tool_list(args.tools_bytes)

        def send(client: httpx.Client, url: str, n: int) -> httpx.Response:
            last = {**tools[-1], "function": {**tools[-1]["function"], "description": f"request {n}"}}
            return client.post(url + CHAT, json=chat(model, tools=[*tools[:-1], last]))

        return send
    if kind == "warm":
        return lambda client, url, n: client.post(url + WARM, json={"documents": warm_documents(args, n)})
    raise ValueError(f"no request for kind {kind!r}")


def warm_documents(args: argparse.Namespace, number: int) -> list[str]:
    """``--warm-documents`` documents, new for every request (the cache would otherwise serve them)."""
    return [
        f"Document {number}-{index}. " + word_text(args.warm_words * 6, args.seed + number * 1000 + index)
        for index in range(args.warm_documents)
    ]


def heavy_client(
    kind: str, args: argparse.Namespace, server: Server, deadline: float, tally: Tally, offset: int
) -> None:
    """Send requests of ``kind`` one after another until ``deadline`` (or the server is gone)."""
    if kind == "slow":
        slow_client(args, server, deadline, tally)
        return
    send = heavy_request(kind, args)
    number = offset
    with httpx.Client(timeout=args.timeout_s) as client:
        while time.monotonic() < deadline and server.alive():
            number += 1
            status, seconds, _ = outcome(lambda n=number: send(client, server.url, n))
            tally.add(status, seconds)


def slow_client(args: argparse.Namespace, server: Server, deadline: float, tally: Tally) -> None:
    """One connection at a time whose 10-byte body arrives a byte every ``--slow-byte-s``, until ``deadline``."""
    body = b'{"a": 1}  '
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}:{server.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    while time.monotonic() < deadline and server.alive():
        started = time.perf_counter()
        status = "sent"
        try:
            with socket.create_connection((HOST, server.port), timeout=args.timeout_s) as sock:
                sock.sendall(head)
                for byte in body:
                    if time.monotonic() > deadline:
                        break
                    sock.sendall(bytes([byte]))
                    time.sleep(args.slow_byte_s)
                answer = sock.recv(64)
                status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"
        except OSError as error:
            status = f"error:{type(error).__name__}"
        tally.add(status, time.perf_counter() - started)


# ---------------------------------------------------------------- one row per kind


def row(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh gateway, the probe, and ``--clients`` heavy clients of ``kind`` for ``--window-s``."""
    with Server(args) as server:
        load_start = machine()["load_average"]
        for _ in range(3):  # the first requests build lazy state: not measured
            outcome(lambda: httpx.post(server.url + CHAT, json=chat(args.model, max_tokens=2), timeout=args.timeout_s))
        probe = Probe(server.url, args).start()
        tally = Tally()
        clients = 0 if kind == "none" else args.clients
        deadline = time.monotonic() + args.window_s
        with ThreadPoolExecutor(max(1, clients)) as pool:
            jobs = [pool.submit(heavy_client, kind, args, server, deadline, tally, i * 100_000) for i in range(clients)]
            if not jobs:
                time.sleep(args.window_s)
            for job in jobs:
                job.result()
        records = probe.finish()
        peak = max((s.rss for s in server.sampler.between(0.0)), default=0) if server.sampler else 0
        alive = server.alive()
    latencies = [seconds for _, seconds, status in records if status == "200"]
    return {
        "kind": kind,
        "clients": clients,
        "window_s": args.window_s,
        "probe_latency_s": spread(latencies),
        "probe_statuses": _count(status for _, _, status in records),
        "heavy_statuses": dict(tally.statuses),
        "heavy_latency_s": spread(tally.seconds),
        "server_peak_rss_gb": round(peak / 2**30, 2),
        "server_alive_at_end": alive,
        "load_average_start": load_start,
        "load_average_end": machine()["load_average"],
    }


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    random.seed(args.seed)
    out = args.out_dir / f"{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "hostile_load",
        "command": sys.argv,
        "machine": machine(),
        "code": served_code(args),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": [],
    }
    for kind in args.kinds:
        result = row(kind, args)
        report["rows"].append(result)
        report["machine_end"] = machine()
        out.write_text(json.dumps(report, indent=2) + "\n")
        latency = result["probe_latency_s"]
        print(
            f"{kind:8s} probe median {latency['median']} p90 {latency['p90']} max {latency['max']} "
            f"(n={latency['n']}); heavy {result['heavy_statuses']}",
            flush=True,
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
