"""The gateway under hostile clients (issue 26): peak RSS and a normal request's latency while N clients
send maximal bodies, and the threads and RSS over 1,000 mixed good and bad requests.

The gateway runs as ``specprefill-rag serve`` in a subprocess on 127.0.0.1 (the embedded SmolLM2-135M
as main and draft by default), started afresh for every row so no row inherits another's memory. A
sampler thread reads its RSS and thread count (the process and its children, psutil) every 50 ms and
is also the watchdog: past ``--rss-limit-gb`` (or with the machine's available memory under
``--min-available-gb``) it kills the server and the row is recorded as cut, with the RSS it reached.

Scenario ``bodies``: for every body size and N in ``--clients``, N client threads each POST a chat body
of that size to /v1/chat/completions, one after another, for ``--window-s`` seconds (requests started in
the window run to their end or their timeout), while a probe process sends a normal 2-token request
every ``--probe-interval-s`` (one client: the next starts when the last has ended); a row with N = 0 is the
probe alone. ``--timeout-s`` is httpx's, per phase (connect, write, read), so a request can take longer in
all. Scenario ``mixed``: ``--mixed-requests`` requests, ``--mixed-concurrency`` at a time, cycling over good
cases (short chat, short completion,
/v1/models) and bad ones (invalid JSON, unknown field, wrong types, huge max_tokens, missing model,
text/plain, a 2 MB body...); RSS and threads every 100 requests, status counts per case, and the cases
that got a 5xx. Results go to ``<out>.json`` (rewritten after every row: a cut run keeps what it
measured) and ``<out>.md``.

    python benchmarks/serve_hostile.py --out benchmarks/results/serve-hostile/after
    python benchmarks/serve_hostile.py --pythonpath /tmp/old-checkout --out benchmarks/results/serve-hostile/before
    python benchmarks/serve_hostile.py --scenarios bodies --clients 1 --body-mb 1 --window-s 5 --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted((ROOT / "examples" / "documents").glob("*.txt"))
SCENARIOS = ("bodies", "mixed")
HOST = "127.0.0.1"  # never anything else
MB = 1_000_000  # body sizes are in 10^6 bytes
PROBE_QUESTION = "What is the capital of France?"
NOTE = (
    "Another process (a package install, a test run) may share this 2-core machine; the load averages at the "
    "start, the end and each row's start say how busy it was. Client and server share the same cores."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "serve-hostile" / "run",
        help="path prefix: writes <out>.json and <out>.md",
    )
    parser.add_argument("--pythonpath", type=Path, help="serve the package from this checkout (PYTHONPATH)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=1, help="times each row (and the mixed run) is measured")
    parser.add_argument("--body-mb", type=float, nargs="+", default=[5.0, 1.0], help="hostile body sizes, 10^6 B")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="hostile clients per row")
    parser.add_argument("--no-baseline", action="store_true", help="leave out the N = 0 (probe only) row")
    parser.add_argument("--window-s", type=float, default=30.0, help="hostile clients start requests this long")
    parser.add_argument("--settle-s", type=float, default=5.0, help="wait after the last request before 'after'")
    parser.add_argument("--probe-interval-s", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="every client request's timeout")
    parser.add_argument("--mixed-requests", type=int, default=1000)
    parser.add_argument("--mixed-concurrency", type=int, default=4, help="1 = sequential")
    parser.add_argument("--mixed-body-mb", type=float, default=2.0, help="the mixed scenario's big body")
    parser.add_argument("--rss-limit-gb", type=float, default=12.0, help="watchdog: kill the server above this RSS")
    parser.add_argument(
        "--min-available-gb",
        type=float,
        default=3.0,
        help="watchdog: kill the server when the machine has less memory available",
    )
    parser.add_argument("--sample-ms", type=float, default=50.0, help="RSS and thread sampling period")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--model", default="smollm2-135m", help="--main and --draft of the gateway")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `serve` (repeat: --serve-arg=--queue-size --serve-arg=64)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- statistics and machine


def spread(values: list[float]) -> dict[str, float | int | None]:
    """Count, median, p90, min and max of some values (None when there are none)."""
    if not values:
        return {"n": 0, "median": None, "p90": None, "min": None, "max": None}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, max(0, round(0.9 * (len(ordered) - 1))))]
    return {"n": len(ordered), "median": statistics.median(ordered), "p90": p90, "min": ordered[0], "max": ordered[-1]}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine() -> dict[str, Any]:
    """This machine now: CPU, cores, memory, load averages."""
    memory = psutil.virtual_memory()
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "memory_total_gb": round(memory.total / 2**30, 1),
        "memory_available_gb": round(memory.available / 2**30, 1),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "time": time.time(),
    }


def git(folder: Path, *command: str) -> str:
    """One git command's output in ``folder`` ('' when it fails)."""
    done = subprocess.run(["git", "-C", str(folder), *command], check=False, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def served_code(args: argparse.Namespace) -> dict[str, Any]:
    """Which code the gateway runs: the checkout, its git revision and changes, the module it imports."""
    folder = (args.pythonpath or ROOT).resolve()
    probe = subprocess.run(
        [sys.executable, "-c", "import specprefill_rag; print(specprefill_rag.__file__)"],
        check=False,
        capture_output=True,
        text=True,
        env=server_env(args),
        cwd=server_cwd(args),
    )
    changed = git(folder, "status", "--porcelain", "--", "specprefill_rag").splitlines()
    return {
        "checkout": str(folder),
        "revision": git(folder, "rev-parse", "HEAD"),
        "describe": git(folder, "describe", "--always", "--dirty"),
        "uncommitted_package_changes": changed,
        "imported_from": probe.stdout.strip() or probe.stderr.strip()[-300:],
        "python": sys.executable,
    }


# ---------------------------------------------------------------- the server and its sampler


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """The server's environment: this one, with ``--pythonpath`` first on PYTHONPATH."""
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(args.pythonpath.resolve()), env.get("PYTHONPATH")) if p)
    return env


def server_cwd(args: argparse.Namespace) -> Path:
    """The server's working directory: the served checkout (``-m`` puts it first on sys.path, before PYTHONPATH)."""
    return (args.pythonpath or ROOT).resolve()


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    """``specprefill-rag serve`` on 127.0.0.1 with the model as main and draft."""
    return [
        sys.executable,
        "-m",
        "specprefill_rag.cli",
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--main",
        args.model,
        "--draft",
        args.model,
        "--log-level",
        "warning",
        *args.serve_arg,
    ]


@dataclass
class Sample:
    """One reading of the server: seconds since the sampler started, RSS bytes, threads."""

    t: float
    rss: int
    threads: int


class Sampler(threading.Thread):
    """Reads the server's RSS and threads every ``period_s``; kills it past the memory limits (the watchdog)."""

    def __init__(self, pid: int, period_s: float, rss_limit: int, min_available: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.period_s, self.rss_limit, self.min_available = period_s, rss_limit, min_available
        self.started = time.monotonic()
        self.samples: list[Sample] = []
        self.cut: dict[str, Any] | None = None
        self.halt = threading.Event()

    def now(self) -> float:
        """Seconds since the sampler started (the samples' clock)."""
        return time.monotonic() - self.started

    def read(self) -> Sample | None:
        """The server's RSS and threads, children included (None once it is gone)."""
        try:
            processes = [self.process, *self.process.children(recursive=True)]
            rss = threads = 0
            for process in processes:
                with process.oneshot():
                    rss += process.memory_info().rss
                    threads += process.num_threads()
            return Sample(self.now(), rss, threads)
        except psutil.Error:
            return None

    def run(self) -> None:
        while not self.halt.is_set():
            sample = self.read()
            if sample is None:
                return
            self.samples.append(sample)
            available = psutil.virtual_memory().available
            if sample.rss > self.rss_limit or available < self.min_available:
                reason = "rss over the limit" if sample.rss > self.rss_limit else "machine memory low"
                self.kill(reason, sample, available)
                return
            self.halt.wait(self.period_s)

    def kill(self, reason: str, sample: Sample, available: int) -> None:
        """Kill the server's process group and record why."""
        self.cut = {
            "reason": reason,
            "rss_mb": sample.rss / 2**20,
            "at_s": sample.t,
            "machine_available_mb": available / 2**20,
        }
        print(f"  WATCHDOG: {reason}: server RSS {sample.rss / 2**30:.2f} GB; killing it", flush=True)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()

    def latest(self) -> Sample | None:
        """A fresh reading, else the last one taken."""
        return self.read() or (self.samples[-1] if self.samples else None)

    def between(self, start: float, end: float | None = None) -> list[Sample]:
        """The samples taken from ``start`` to ``end`` (now)."""
        end = self.now() if end is None else end
        return [s for s in self.samples if start <= s.t <= end]

    def series(self, start: float, every_s: float = 1.0) -> list[list[float]]:
        """``[t, rss MB, threads]`` about every ``every_s`` from ``start`` (for plots), peak samples kept."""
        chosen, last, samples = [], -1e9, self.between(start)
        peak = max(samples, key=lambda s: s.rss, default=None)
        for sample in samples:
            if sample.t - last >= every_s or sample is peak:
                chosen.append([round(sample.t - start, 2), round(sample.rss / 2**20, 1), sample.threads])
                last = sample.t
        return chosen


class Server:
    """One gateway subprocess (its own process group, log in a temporary file) and its sampler."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        handle, name = tempfile.mkstemp(prefix="serve-hostile-", suffix=".log")
        self.log_path, self.log = Path(name), os.fdopen(handle, "wb")
        self.process: subprocess.Popen | None = None
        self.sampler: Sampler | None = None
        self.startup_s = 0.0

    def __enter__(self) -> Self:
        started = time.monotonic()
        self.process = subprocess.Popen(
            serve_command(self.args, self.port),
            env=server_env(self.args),
            cwd=server_cwd(self.args),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.sampler = Sampler(
            self.process.pid,
            self.args.sample_ms / 1000,
            int(self.args.rss_limit_gb * 2**30),
            int(self.args.min_available_gb * 2**30),
        )
        self.sampler.start()
        self.wait_healthy(started + self.args.startup_timeout_s)
        self.startup_s = time.monotonic() - started
        return self

    def wait_healthy(self, deadline: float) -> None:
        """Return once /health answers 200; raise if the server exits or the deadline passes."""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the gateway did not answer /health in {self.args.startup_timeout_s} s")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's output, progress bars left out."""
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").replace("\r", "\n").splitlines()
        return "\n".join(line for line in lines if line.strip() and "it/s]" not in line and "%|" not in line)[-chars:]

    def __exit__(self, *_: object) -> None:
        if self.sampler:
            self.sampler.halt.set()
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        self.log_path.unlink(missing_ok=True)


# ---------------------------------------------------------------- requests


def outcome(call: Callable[[], httpx.Response]) -> tuple[str, float, str]:
    """``(status, seconds, body start)`` of one request; status is the HTTP code, 'timeout' or 'error:<type>'."""
    started = time.perf_counter()
    try:
        response = call()
        return str(response.status_code), time.perf_counter() - started, response.text[:300]
    except httpx.TimeoutException:
        return "timeout", time.perf_counter() - started, ""
    except httpx.HTTPError as error:
        return f"error:{type(error).__name__}", time.perf_counter() - started, str(error)[:300]


def probe_body(model: str) -> bytes:
    """The normal request: a short question, 2 tokens, greedy."""
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": PROBE_QUESTION}],
        "max_tokens": 2,
        "temperature": 0,
    }
    return json.dumps(payload).encode()


def word_text(size: int, seed: int) -> str:
    """About ``size`` bytes of English-ish text: words of the example documents in a random order, in sentences."""
    vocabulary = [w for path in DOCUMENTS for w in path.read_text().split() if w.isascii()]
    rng = random.Random(seed)
    words = rng.choices(vocabulary, k=size // 5 + 16)
    for index in range(0, len(words), 17):
        words[index] = words[index].rstrip(".,;") + "."
    return " ".join(words)[:size]


class ChatBodies:
    """Chat bodies of a given size, different for every request (a request number at the front)."""

    def __init__(self, model: str, size: int, seed: int) -> None:
        text = json.dumps(word_text(size, seed))[1:-1].encode()
        self.head = json.dumps({"model": model, "messages": [{"role": "user", "content": "@"}]}).encode()
        self.head, self.tail = self.head.split(b"@")
        self.tail = self.tail[:-1] + b', "max_tokens": 2}'
        self.text, self.counter, self.lock = text, 0, threading.Lock()

    def next(self) -> bytes:
        """The next body (thread-safe)."""
        with self.lock:
            self.counter += 1
            number = self.counter
        return self.head + f"request {number}: ".encode() + self.text + self.tail


def probe_loop(url: str, model: str, interval_s: float, timeout_s: float, stop: Any, results: Any) -> None:
    """In a process of its own: the normal request every ``interval_s`` until ``stop``; puts the list of
    ``[epoch start, seconds, status]`` on ``results``."""
    records, body = [], probe_body(model)
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=timeout_s) as client:
        while not stop.is_set():
            started = time.time()
            status, seconds, _ = outcome(
                lambda: client.post(url + "/v1/chat/completions", content=body, headers=headers)
            )
            records.append([started, seconds, status])
            stop.wait(max(0.0, started + interval_s - time.time()))
    results.put(records)


class Probe:
    """The probe process: started, then stopped and its records collected."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop, self.results, self.timeout_s = context.Event(), context.Queue(), args.timeout_s
        self.process = context.Process(
            target=probe_loop,
            daemon=True,
            args=(url, args.model, args.probe_interval_s, args.timeout_s, self.stop, self.results),
        )

    def start(self) -> Probe:
        self.process.start()
        return self

    def finish(self) -> list[list[Any]]:
        """Stop the probe after its current request and return its records."""
        self.stop.set()
        records = self.results.get(timeout=self.timeout_s + 60)
        self.process.join(timeout=10)
        return records


@dataclass
class Tally:
    """Statuses and latencies of many requests (thread-safe)."""

    statuses: Counter = field(default_factory=Counter)
    seconds: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, status: str, seconds: float) -> None:
        with self.lock:
            self.statuses[status] += 1
            self.seconds.append(seconds)


def hostile_client(server: Server, bodies: ChatBodies, deadline: float, timeout_s: float, tally: Tally) -> None:
    """POST maximal chat bodies one after another until ``deadline`` (or the server is gone)."""
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=timeout_s) as client:
        while time.monotonic() < deadline and server.alive():
            body = bodies.next()
            status, seconds, _ = outcome(
                lambda body=body: client.post(server.url + "/v1/chat/completions", content=body, headers=headers)
            )
            tally.add(status, seconds)


def warm_up(server: Server, args: argparse.Namespace, count: int = 3) -> list[list[Any]]:
    """A few normal requests before measuring (the first loads lazily built state): ``[status, seconds]``."""
    with httpx.Client(timeout=args.timeout_s) as client:
        done = [
            outcome(
                lambda: client.post(
                    server.url + "/v1/chat/completions",
                    content=probe_body(args.model),
                    headers={"content-type": "application/json"},
                )
            )
            for _ in range(count)
        ]
    return [[status, round(seconds, 3)] for status, seconds, _ in done]


# ---------------------------------------------------------------- scenario: bodies


def memory_summary(sampler: Sampler, start: float, before: Sample | None, after: Sample | None) -> dict[str, Any]:
    """RSS and threads before, at peak and after, from ``start`` on."""
    samples = sampler.between(start)
    peak_rss = max((s.rss for s in samples), default=0)
    peak_threads = max((s.threads for s in samples), default=0)

    def megabytes(sample):
        return None if sample is None else round(sample.rss / 2**20, 1)

    return {
        "rss_before_mb": megabytes(before),
        "rss_peak_mb": round(peak_rss / 2**20, 1),
        "rss_after_mb": megabytes(after) if sampler.cut is None else None,
        "threads_before": before.threads if before else None,
        "threads_peak": peak_threads,
        "threads_after": after.threads if after and sampler.cut is None else None,
        "samples": len(samples),
        "cut": sampler.cut,
    }


def probe_summary(records: list[list[Any]], origin_epoch: float) -> dict[str, Any]:
    """The probe's latency spread (seconds), statuses, and its raw ``[start s, seconds, status]`` records."""
    return {
        "latency_s": spread([r[1] for r in records]),
        "statuses": dict(Counter(r[2] for r in records)),
        "records": [[round(r[0] - origin_epoch, 2), round(r[1], 3), r[2]] for r in records],
    }


def server_cpu_seconds(server: Server) -> float | None:
    """User + system CPU seconds the server has used so far."""
    try:
        times = psutil.Process(server.process.pid).cpu_times()
        return times.user + times.system
    except psutil.Error:
        return None


def settle(server: Server, seconds: float) -> float | None:
    """Wait ``seconds``; the server's CPU use meanwhile, in cores (high: it is still busy with old requests)."""
    first = server_cpu_seconds(server)
    time.sleep(seconds)
    last = server_cpu_seconds(server)
    return None if first is None or last is None else round((last - first) / seconds, 2)


def bodies_row(args: argparse.Namespace, clients: int, body_mb: float, repeat: int) -> dict[str, Any]:
    """One row: ``clients`` hostile clients with ``body_mb`` bodies (0 clients: the probe alone)."""
    row: dict[str, Any] = {
        "clients": clients,
        "body_mb": body_mb,
        "repeat": repeat,
        "window_s": args.window_s,
        "load_average_at_start": os.getloadavg(),
    }
    bodies = ChatBodies(args.model, int(body_mb * MB), args.seed + repeat) if clients else None
    row["body_bytes"] = len(bodies.next()) if bodies else 0
    with Server(args) as server:
        row["startup_s"], row["warm_up"] = round(server.startup_s, 1), warm_up(server, args)
        time.sleep(1.0)
        before, start, origin = server.sampler.latest(), server.sampler.now(), time.time()
        probe, tally = Probe(server.url, args).start(), Tally()
        time.sleep(0.5)  # the probe process is importing httpx
        deadline = time.monotonic() + args.window_s
        threads = [
            threading.Thread(target=hostile_client, args=(server, bodies, deadline, args.timeout_s, tally), daemon=True)
            for _ in range(clients)
        ]
        for thread in threads:
            thread.start()
        time.sleep(max(0.0, deadline - time.monotonic()))
        for thread in threads:
            thread.join()
        row["drain_s"] = round(max(0.0, time.monotonic() - deadline), 1)
        row["probe"] = probe_summary(probe.finish(), origin)
        row["server_cores_busy_during_settle"] = settle(server, args.settle_s) if server.alive() else None
        row.update(memory_summary(server.sampler, start, before, server.sampler.latest()))
        row["hostile"] = {
            "requests": sum(tally.statuses.values()),
            "statuses": dict(tally.statuses),
            "latency_s": spread(tally.seconds),
        }
        row["rss_series"] = server.sampler.series(start)
        row["server_alive_at_end"] = server.alive()
        row["server_log_tail"] = server.log_tail(1500)
    return row


def print_body_row(row: dict[str, Any]) -> None:
    """One line per measured row."""
    probe = row["probe"]["latency_s"]
    print(
        f"  N={row['clients']:>2} {row['body_mb']:g} MB: RSS {row['rss_before_mb']} -> peak {row['rss_peak_mb']} "
        f"-> {row['rss_after_mb']} MB, threads {row['threads_before']}/{row['threads_peak']}/{row['threads_after']}, "
        f"probe median {fmt(probe['median'])} max {fmt(probe['max'])} s {row['probe']['statuses']}, hostile "
        f"{row['hostile']['statuses']}{'  CUT' if row['cut'] else ''}",
        flush=True,
    )


# ---------------------------------------------------------------- scenario: mixed


def mixed_cases(args: argparse.Namespace) -> dict[str, tuple[str, str, str, bytes, str | None]]:
    """Case name -> (good/bad, method, path, body, content type)."""
    model, json_type = args.model, "application/json"
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": PROBE_QUESTION}],
        "max_tokens": 2,
        "temperature": 0,
    }

    def chat_with(**changes: Any) -> bytes:
        payload = {**chat, **changes}
        return json.dumps({k: v for k, v in payload.items() if v is not ...}).encode()

    completion = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 2}).encode()
    big = ChatBodies(model, int(args.mixed_body_mb * MB), args.seed + 99).next()
    chat_path, text_path = "/v1/chat/completions", "/v1/completions"
    return {
        "good_chat": ("good", "POST", chat_path, chat_with(), json_type),
        "good_completion": ("good", "POST", text_path, completion, json_type),
        "good_models": ("good", "GET", "/v1/models", b"", None),
        "invalid_json": ("bad", "POST", chat_path, b'{"model": "' + model.encode() + b'", "messages": [', json_type),
        "invalid_utf8": ("bad", "POST", chat_path, b'{"model": "\xff\xfe"}', json_type),
        "empty_body": ("bad", "POST", chat_path, b"", json_type),
        "json_array": ("bad", "POST", chat_path, b"[1, 2, 3]", json_type),
        "deep_nesting": ("bad", "POST", chat_path, b"[" * 100_000 + b"]" * 100_000, json_type),
        "unknown_field": ("bad", "POST", chat_path, chat_with(frobnicate=1), json_type),
        "wrong_type_max_tokens": ("bad", "POST", chat_path, chat_with(max_tokens="two"), json_type),
        "wrong_type_messages": ("bad", "POST", chat_path, chat_with(messages="hello"), json_type),
        "huge_max_tokens": ("bad", "POST", chat_path, chat_with(max_tokens=10**12), json_type),
        "missing_model": ("bad", "POST", chat_path, chat_with(model=...), json_type),
        "wrong_model": ("bad", "POST", chat_path, chat_with(model="gpt-5"), json_type),
        "text_plain": ("bad", "POST", chat_path, chat_with(), "text/plain"),
        f"body_{args.mixed_body_mb:g}mb": ("bad", "POST", chat_path, big, json_type),
    }


def mixed_order(names: list[str], count: int, seed: int) -> list[str]:
    """``count`` case names: every case once per cycle, each cycle shuffled."""
    rng, order = random.Random(seed), []
    while len(order) < count:
        cycle = list(names)
        rng.shuffle(cycle)
        order += cycle
    return order[:count]


def mixed_run(args: argparse.Namespace, repeat: int) -> dict[str, Any]:
    """``--mixed-requests`` mixed requests, checkpoints of RSS and threads every 100."""
    cases = mixed_cases(args)
    order = mixed_order(list(cases), args.mixed_requests, args.seed + repeat)
    per_case: dict[str, Tally] = {name: Tally() for name in cases}
    examples: dict[str, dict[str, str]] = {name: {} for name in cases}
    run: dict[str, Any] = {
        "repeat": repeat,
        "requests": len(order),
        "concurrency": args.mixed_concurrency,
        "settle_s": args.settle_s,
        "load_average_at_start": os.getloadavg(),
        "checkpoints": [],
    }
    with (
        Server(args) as server,
        httpx.Client(timeout=args.timeout_s, limits=httpx.Limits(max_connections=args.mixed_concurrency + 2)) as client,
    ):
        run["startup_s"], run["warm_up"] = round(server.startup_s, 1), warm_up(server, args)
        time.sleep(1.0)
        before, start = server.sampler.latest(), server.sampler.now()
        run["checkpoints"].append(checkpoint(0, before, server, start))

        def send(name: str) -> None:
            _, method, path, body, content_type = cases[name]
            headers = {"content-type": content_type} if content_type else {}
            status, seconds, text = outcome(
                lambda: client.request(method, server.url + path, content=body or None, headers=headers)
            )
            per_case[name].add(status, seconds)
            examples[name].setdefault(status, text)

        with ThreadPoolExecutor(args.mixed_concurrency) as pool:
            for first in range(0, len(order), 100):
                list(pool.map(send, order[first : first + 100]))
                run["checkpoints"].append(
                    checkpoint(min(first + 100, len(order)), server.sampler.latest(), server, start)
                )
                if not server.alive():
                    break
        run["server_cores_busy_during_settle"] = settle(server, args.settle_s) if server.alive() else None
        run.update(memory_summary(server.sampler, start, before, server.sampler.latest()))
        run["cases"] = mixed_case_results(cases, per_case, examples)
        run["status_counts"] = dict(sum((t.statuses for t in per_case.values()), Counter()))
        run["five_xx"] = {name: c for name, c in run["cases"].items() if any(s.startswith("5") for s in c["statuses"])}
        run["rss_series"] = server.sampler.series(start)
        run["server_alive_at_end"] = server.alive()
        run["server_log_tail"] = server.log_tail(3000)
    return run


def checkpoint(done: int, sample: Sample | None, server: Server, start: float) -> dict[str, Any]:
    """RSS and threads after ``done`` requests."""
    return {
        "after_requests": done,
        "t_s": round(server.sampler.now() - start, 1),
        "rss_mb": round(sample.rss / 2**20, 1) if sample else None,
        "threads": sample.threads if sample else None,
        "alive": server.alive(),
    }


def mixed_case_results(
    cases: dict[str, tuple], per_case: dict[str, Tally], examples: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """Per case: good or bad, status counts, latency spread, and the start of one answer per status."""
    return {
        name: {
            "kind": cases[name][0],
            "statuses": dict(tally.statuses),
            "latency_s": spread(tally.seconds),
            "example_by_status": {s: t[:200] for s, t in examples[name].items()},
        }
        for name, tally in per_case.items()
    }


def print_mixed(run: dict[str, Any]) -> None:
    """The checkpoints and the 5xx cases of one mixed run."""
    points = run["checkpoints"]
    print(
        f"  mixed: RSS {[p['rss_mb'] for p in points]} MB, threads {[p['threads'] for p in points]}; "
        f"statuses {run['status_counts']}; 5xx in {sorted(run['five_xx']) or 'none'}",
        flush=True,
    )


# ---------------------------------------------------------------- results


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write(report: dict[str, Any], out: Path) -> None:
    """``<out>.json`` and ``<out>.md`` (called after every row)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))


def statuses_text(statuses: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())) or "-"


def markdown(report: dict[str, Any]) -> str:
    """A short markdown summary of the report."""
    code, start, settings = report["served_code"], report["machine_start"], report["settings"]
    end = report.get("machine_end") or {}
    changed = " with uncommitted package changes" if code["uncommitted_package_changes"] else ""
    lines = [
        f"# Gateway under hostile clients (issue 26): {report['name']}",
        "",
        (
            f"Served code: `{code['describe'] or code['revision']}` from `{code['checkout']}` "
            f"(imports `{code['imported_from']}`){changed}."
        ),
        (
            f"Machine: {start['cpu_model']}, {start['cores']} cores, {start['memory_total_gb']} GB; load average "
            f"{fmt_load(start['load_average'])} at start, {fmt_load(end.get('load_average'))} at end. {NOTE}"
        ),
        (
            f"Settings: window {settings['window_s']} s per row, probe every {settings['probe_interval_s']} s "
            f"(one sequential client: a blocked probe gives few samples), request timeout {settings['timeout_s']} "
            f"s (httpx's, per connect / write / read: a request can take longer in all), settle "
            f"{settings['settle_s']} s, watchdog {settings['rss_limit_gb']} GB, a fresh server per row. "
            f"Complete: {report['complete']}."
        ),
        "",
    ]
    if report["bodies"]:
        lines += [
            "## Maximal bodies",
            "",
            (
                "| N | body MB | RSS before / peak / after MB | threads before / peak / after | probe s median / "
                "p90 / max | probe statuses | hostile requests: statuses | hostile s median / max | drain s | cut | "
                "load 1 min |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in report["bodies"]:
            probe, hostile = row["probe"]["latency_s"], row["hostile"]
            cut = f"at {row['cut']['rss_mb']:.0f} MB ({row['cut']['reason']})" if row["cut"] else "no"
            lines.append(
                f"| {row['clients']} | {row['body_mb']:g} | {row['rss_before_mb']} / {row['rss_peak_mb']} / "
                f"{row['rss_after_mb'] or '-'} | {row['threads_before']} / {row['threads_peak']} / "
                f"{row['threads_after'] or '-'} | {fmt(probe['median'])} / {fmt(probe['p90'])} / {fmt(probe['max'])} "
                f"| {statuses_text(row['probe']['statuses'])} | {hostile['requests']}: "
                f"{statuses_text(hostile['statuses'])} | {fmt(hostile['latency_s']['median'])} / "
                f"{fmt(hostile['latency_s']['max'])} | {row['drain_s']} | {cut} | "
                f"{row['load_average_at_start'][0]:.2f} |"
            )
        lines.append("")
    for run in report["mixed"]:
        lines += mixed_markdown(run)
    return "\n".join(lines) + "\n"


def fmt_load(load: Any) -> str:
    return "-" if not load else "/".join(f"{x:.2f}" for x in load)


def mixed_markdown(run: dict[str, Any]) -> list[str]:
    """The mixed run's checkpoints, status counts per case and 5xx cases."""
    points = run["checkpoints"]
    lines = [
        (
            f"## Mixed good and bad requests (repeat {run['repeat']}: {run['requests']} requests, "
            f"{run['concurrency']} at a time)"
        ),
        "",
        "| after requests | " + " | ".join(str(p["after_requests"]) for p in points) + " |",
        "|---|" + "---|" * len(points),
        "| RSS MB | " + " | ".join(str(p["rss_mb"]) for p in points) + " |",
        "| threads | " + " | ".join(str(p["threads"]) for p in points) + " |",
        "",
        (
            f"Peak RSS {run['rss_peak_mb']} MB, peak threads {run['threads_peak']}; after a {run['settle_s']} s "
            f"settle: RSS {run['rss_after_mb']} MB, threads {run['threads_after']}."
        ),
        "",
        "| case | kind | statuses | latency s median / p90 / max |",
        "|---|---|---|---|",
    ]
    for name, case in run["cases"].items():
        spread_ = case["latency_s"]
        lines.append(
            f"| {name} | {case['kind']} | {statuses_text(case['statuses'])} | {fmt(spread_['median'], 3)} / "
            f"{fmt(spread_['p90'], 3)} / {fmt(spread_['max'], 3)} |"
        )
    five = ", ".join(f"{n} ({statuses_text(c['statuses'])})" for n, c in run["five_xx"].items()) or "none"
    return lines + ["", f"5xx: {five}.", ""]


def main(argv: list[str] | None = None) -> int:
    """Run the chosen scenarios, writing the results after every row."""
    args = parse_args(argv)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report: dict[str, Any] = {
        "benchmark": "serve_hostile",
        "issue": 26,
        "name": args.out.name,
        "settings": settings,
        "serve_command": serve_command(args, 0),
        "served_code": served_code(args),
        "machine_start": machine(),
        "note": NOTE,
        "bodies": [],
        "mixed": [],
        "complete": False,
    }
    print(f"serving {report['served_code']['imported_from']} ({report['served_code']['describe']})", flush=True)
    write(report, args.out)
    rows = ([] if args.no_baseline else [(0, 0.0)]) + [(n, mb) for mb in args.body_mb for n in args.clients]
    for repeat in range(args.repeats):
        if "bodies" in args.scenarios:
            for clients, body_mb in rows:
                row = bodies_row(args, clients, body_mb, repeat)
                report["bodies"].append(row)
                print_body_row(row)
                write(report, args.out)
        if "mixed" in args.scenarios:
            run = mixed_run(args, repeat)
            report["mixed"].append(run)
            print_mixed(run)
            write(report, args.out)
    report["machine_end"], report["complete"] = machine(), True
    write(report, args.out)
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
