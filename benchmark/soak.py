"""Soak: mixed requests against a MAGICDEC server on a pool smaller than they need, watching for
anything lost or leaked.

    .venv/bin/python -m benchmark.soak [--requests 1000] [--concurrency 16]
    .venv/bin/python -m benchmark.soak --model qwen --prompt-tokens 1024 32000 --pool 60000 \\
        --minutes 30 --requests 100000 --concurrency 8 --out benchmark/results/soak_long

Not part of CI (the first: 10-15 minutes on two cores; `test/test_soak_server.py` runs a small
one). The mix: questions about 4 shared PG-19 documents (summaries shared by prefix) and
unshared prompts cut from other books at random offsets, both of lengths drawn from
`--prompt-tokens`; greedy and sampled, 4-32 new tokens; 5% of requests aborted at a random moment
(`--aborts`), 5% streamed and dropped by the client after a few chunks (`--drops`), `flush_cache`
tried at random moments (SGLang refuses it while requests run). The pool (`--pool`) is far
smaller than the concurrent requests need, so SGLang queues, the radix cache evicts all along,
and SGLang's own test switch retracts running requests every 50 decode steps (the pool alone
rarely forces it: SGLang admits requests with KV reserved for their rounds). Every few seconds it
samples the server's resident memory (all its processes), KV tokens in use and SnapKV summary
counts. At the end, with all requests done, the cache flushed: KV in use and summaries held must
be 0, no request may have failed, and resident memory in the last third of the run must not
exceed the middle third's by more than 5%.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from benchmark.common import DEFAULT_DATA, MODELS, RESULTS, magicdec_info, stream_chunks
from benchmark.server_process import ServerProcess, start_server
from sglang_magicdec.model import embedded_model_path

SPECULATIVE = [
    "--speculative-algorithm", "MAGICDEC", "--magicdec-draft", "snapkv",
    "--magicdec-budget", "256", "--magicdec-share-min-len", "512",
]  # fmt: skip
RETRACT_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "50"}
RSS_GROWTH_LIMIT = 1.05
QUESTIONS = 40


def build_prompts(
    data: Path, tokenizer, rng: random.Random, lengths: tuple[int, int]
) -> tuple[list, list]:
    """Questions over 4 shared documents, and 200 unshared excerpts, of lengths in `lengths`."""
    low, high = lengths
    books = []
    for line in (data / "pg19" / "pg19_32K.jsonl").open():
        books.append(tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"])
        if len(books) == 10:
            break
    documents = [book[: rng.randint(low, high)] for book in books[:4]]
    questions = [f" Question {i}: what happens in part {i % 7}?" for i in range(QUESTIONS)]
    shared = [
        doc + tokenizer(q, add_special_tokens=False)["input_ids"]
        for doc in documents
        for q in questions
    ]
    unshared = []
    for _ in range(200):
        book = rng.choice(books[4:])
        length = min(rng.randint(low, high), len(book) - 1)
        start = rng.randrange(0, len(book) - length)
        unshared.append(book[start : start + length])
    return shared, unshared


@dataclass
class Outcomes:
    finished: int = 0
    aborted: int = 0
    dropped: int = 0  # streams the client closed
    errors: list = field(default_factory=list)
    flushes_accepted: int = 0
    retracted: int = 0


def make_job(index: int, rng: random.Random, shared: list, unshared: list, args) -> dict:
    prompt = rng.choice(shared) if rng.random() < 0.85 else rng.choice(unshared)
    sampled = rng.random() < 0.3
    end = rng.random()
    drop = args.aborts <= end < args.aborts + args.drops
    return {
        "rid": f"soak-{index:06d}-",
        "input_ids": prompt,
        "sampling_params": {
            "max_new_tokens": rng.randint(4, 32),
            "temperature": 0.8 if sampled else 0.0,
            "ignore_eos": True,
        },
        "abort_after_s": rng.uniform(0.5, 8) if end < args.aborts else None,
        "drop_after_chunks": rng.randint(1, 3) if drop else None,
        "flush": rng.random() < 0.02,
    }


def abort(server: ServerProcess, rid: str) -> None:
    try:
        requests.post(f"{server.url}/abort_request", json={"rid": rid}, timeout=600)
    except requests.ConnectionError:
        pass  # the soak ended and its server stopped before this request's moment came


def send(server: ServerProcess, job: dict, outcomes: Outcomes, lock: threading.Lock) -> None:
    if job["abort_after_s"] is not None:
        timer = threading.Timer(job["abort_after_s"], abort, args=(server, job["rid"]))
        timer.daemon = True
        timer.start()
    if job["flush"]:
        flushed = requests.post(f"{server.url}/flush_cache", timeout=600).status_code == 200
        with lock:
            outcomes.flushes_accepted += flushed
    payload = {key: job[key] for key in ("rid", "input_ids", "sampling_params")}
    if job["drop_after_chunks"] is not None:
        payload["stream"] = True
        chunks = 0
        with requests.post(f"{server.url}/generate", json=payload, stream=True, timeout=3600) as r:
            for _ in stream_chunks(r):
                chunks += 1
                if chunks == job["drop_after_chunks"]:
                    break  # leaving the block closes the connection: SGLang aborts the request
        with lock:
            if r.status_code != 200:
                outcomes.errors.append(f"{r.status_code} (stream)")
            elif chunks == job["drop_after_chunks"]:
                outcomes.dropped += 1
            else:
                outcomes.finished += 1  # it ended before the client meant to drop it
        return
    response = requests.post(f"{server.url}/generate", json=payload, timeout=3600)
    with lock:
        if response.status_code != 200:
            outcomes.errors.append(f"{response.status_code}: {response.text[:200]}")
            return
        meta = response.json()["meta_info"]
        outcomes.retracted += meta.get("num_retractions", 0)
        if meta["finish_reason"]["type"] == "abort":
            outcomes.aborted += 1
        else:
            outcomes.finished += 1


@dataclass
class Sampler:
    """The server's resident memory, KV in use and SnapKV summaries every `every_s` seconds."""

    server: ServerProcess
    every_s: float
    samples: list = field(default_factory=list)
    missed: int = 0  # samples the server did not answer in time
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        root = psutil.Process(self.server.process.pid)
        start = time.monotonic()
        while not self.done.wait(self.every_s):
            processes = [root, *self.server.children()]
            rss = sum(p.memory_info().rss for p in processes if p.is_running())
            try:
                # Both answer from the scheduler, which a long prefill chunk holds for minutes.
                load = requests.get(f"{self.server.url}/v1/loads", timeout=600).json()
                info = magicdec_info(self.server.url, timeout=600)
            except requests.RequestException:
                self.missed += 1
                continue
            self.samples.append(
                {
                    "t": time.monotonic() - start,
                    "rss_mb": rss / 2**20,
                    "kv_used": load["loads"][0]["num_used_tokens"],
                    "stored": info["summaries_stored"],
                    "held": info["summaries_held"],
                }
            )


def soak(server: ServerProcess, shared: list, unshared: list, args) -> dict:
    """Send requests (`args.requests`, or until `args.minutes` have passed, when what still runs
    is aborted) `args.concurrency` at a time, then flush the cache once idle; the outcomes, the
    samples and the final state."""
    rng = random.Random(args.seed)
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else float("inf")
    outcomes, lock = Outcomes(), threading.Lock()
    sampler = Sampler(server, args.sample_every_s)
    counter = iter(range(args.requests))

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                index = next(counter, None)
                job = None if index is None else make_job(index, rng, shared, unshared, args)
            if job is None:
                return
            send(server, job, outcomes, lock)

    thread = threading.Thread(target=sampler.run, daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            futures = [pool.submit(worker) for _ in range(args.concurrency)]
            left = None if args.minutes is None else max(0.0, deadline - time.monotonic())
            _, running = wait(futures, timeout=left)
            if running:
                # Time is up: what is still queued or running is aborted (a request queued
                # behind long prefills could otherwise take many minutes more).
                abort_all = {"rid": "", "abort_all": True}
                requests.post(f"{server.url}/abort_request", json=abort_all, timeout=600)
            for future in futures:
                future.result()
        elapsed = time.monotonic() - started
        time.sleep(2)  # aborted and dropped requests leave the scheduler
        for _ in range(60):
            if requests.post(f"{server.url}/flush_cache", timeout=30).status_code == 200:
                break
            time.sleep(1)
        final_load = requests.get(f"{server.url}/v1/loads", timeout=30).json()["loads"][0]
        final_info = magicdec_info(server.url)
    finally:
        sampler.done.set()
    return {
        "outcomes": outcomes,
        "samples": sampler.samples,
        "missed_samples": sampler.missed,
        "elapsed_s": elapsed,
        "kv_used_after": final_load["num_used_tokens"],
        "info_after": final_info,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--minutes", type=float, help="stop sending after this long")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--aborts", type=float, default=0.05, help="share of requests aborted")
    parser.add_argument("--drops", type=float, default=0.05, help="share of streams dropped")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[256, 1000])
    parser.add_argument("--pool", type=int, default=8000, help="--max-total-tokens")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model_path = str(embedded_model_path(MODELS[args.model]))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    shared, unshared = build_prompts(
        args.data, tokenizer, random.Random(args.seed), tuple(args.prompt_tokens)
    )
    server_args = [
        "--model-path", model_path, "--dtype", args.dtype, "--max-total-tokens", str(args.pool),
        *SPECULATIVE,
    ]  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="soak-"))
    server = start_server(server_args, logs, timeout_s=900, env=RETRACT_ENV)
    try:
        result = soak(server, shared, unshared, args)
    finally:
        server.stop()
    report = summarise(result, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(report)
    args.out.with_suffix(".json").write_text(json.dumps(result["samples"]))
    print(report)


def leaks(result: dict) -> dict[str, int]:
    """What must be 0 after a soak: failed requests, KV in use, SnapKV summaries held."""
    return {
        "failed requests": len(result["outcomes"].errors),
        "KV in use after the run (tokens)": result["kv_used_after"],
        "summaries held after the run": result["info_after"]["summaries_held"],
    }


def summarise(result: dict, args) -> str:
    samples, outcomes, info = result["samples"], result["outcomes"], result["info_after"]
    third = max(1, len(samples) // 3)
    middle = statistics.median(s["rss_mb"] for s in samples[third : 2 * third])
    last = statistics.median(s["rss_mb"] for s in samples[2 * third :])
    low, high = args.prompt_tokens
    lines = [
        f"Soak: {args.model} {args.dtype}, prompts of {low}-{high} tokens, pool {args.pool} "
        f"tokens, concurrency {args.concurrency}, {result['elapsed_s'] / 60:.1f} min; "
        f"{outcomes.finished} finished, {outcomes.aborted} aborted, {outcomes.dropped} streams "
        f"dropped by the client, {len(outcomes.errors)} failed; {outcomes.retracted} "
        f"retractions; flush_cache accepted {outcomes.flushes_accepted} times",
        "",
        f"summaries computed {info['summaries_computed']}, reused {info['summaries_reused']}, "
        f"dropped {info['summaries_dropped']}, stored at most "
        f"{max(s['stored'] for s in samples)} (after the run: {info['summaries_stored']}); "
        f"drafts without a summary {info['drafts_without_summary']}",
        f"KV in use: at most {max(s['kv_used'] for s in samples)} of {args.pool} tokens "
        f"({len(samples)} samples; {result['missed_samples']} not answered within 600 s)",
        f"resident memory (MB): first sample {samples[0]['rss_mb']:.0f}, median of the middle "
        f"third {middle:.0f}, of the last third {last:.0f}, max "
        f"{max(s['rss_mb'] for s in samples):.0f}",
        "",
    ]
    bounded = last <= middle * RSS_GROWTH_LIMIT
    lines.append(
        f"- resident memory, last third vs middle third: {last / middle:.3f} "
        f"({'bounded' if bounded else 'GREW'})"
    )
    for name, value in leaks(result).items():
        lines.append(f"- {name}: {value} ({'ok' if value == 0 else 'LEAK'})")
    lines += [f"- error: {error}" for error in outcomes.errors[:10]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
