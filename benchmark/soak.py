"""Soak: 1,000 mixed requests against a MAGICDEC server on a small pool, watching for leaks.

    .venv/bin/python -m benchmark.soak [--requests 1000] [--concurrency 16]

Not part of CI (10-15 minutes on two cores). The mix: questions about 4 shared PG-19 documents
(summaries shared by prefix) and unshared prompts cut from other books at random offsets, greedy
and sampled, 4-32 new tokens; 5% of requests aborted at a random moment, `flush_cache` tried at
random moments (SGLang refuses it while requests run). The pool (--max-total-tokens 8000) is far
smaller than 16 requests need, so the radix cache evicts all along; SGLang's own test switch
retracts running requests every 50 decode steps (the pool alone rarely forces it: SGLang admits
requests with KV reserved for their rounds). Every few seconds it samples the server's resident
memory (all its processes), KV tokens in use and SnapKV summary counts. At the end, with all
requests done, the cache flushed: KV in use and summaries held must be 0, and resident memory in
the last third of the run must not exceed the middle third's by more than 5%.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from benchmark.common import DEFAULT_DATA, RESULTS, load_tokenizer, magicdec_info
from benchmark.server_process import start_server

SERVER_ARGS = [
    "--dtype", "float32", "--max-total-tokens", "8000",
    "--speculative-algorithm", "MAGICDEC", "--magicdec-draft", "snapkv",
    "--magicdec-budget", "256", "--magicdec-share-min-len", "512",
]  # fmt: skip
RETRACT_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "50"}
RSS_GROWTH_LIMIT = 1.05


def build_prompts(data: Path, tokenizer, rng: random.Random) -> tuple[list, list]:
    with (data / "pg19" / "pg19_4K.jsonl").open() as handle:
        books = [tokenizer(json.loads(line)["text"])["input_ids"] for line in handle]
    documents = [book[:1000] for book in books[:4]]
    questions = [f" Question {i}: what happens in part {i % 7}?" for i in range(40)]
    shared = [doc + tokenizer(q)["input_ids"] for doc in documents for q in questions]
    unshared = []
    for _ in range(200):
        book = rng.choice(books[4:])
        length = rng.randint(256, 512)
        start = rng.randrange(0, len(book) - length)
        unshared.append(book[start : start + length])
    return shared, unshared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    tokenizer = load_tokenizer()
    shared, unshared = build_prompts(args.data, tokenizer, rng)
    server = start_server(SERVER_ARGS, Path(tempfile.mkdtemp(prefix="soak-")), env=RETRACT_ENV)
    samples: list[dict] = []
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(server.process.pid)
        start = time.monotonic()
        while not done.wait(args.sample_every_s):
            processes = [root, *root.children(recursive=True)]
            rss = sum(p.memory_info().rss for p in processes if p.is_running())
            load = requests.get(f"{server.url}/v1/loads", timeout=30).json()["loads"][0]
            info = magicdec_info(server.url)
            samples.append(
                {
                    "t": time.monotonic() - start,
                    "rss_mb": rss / 2**20,
                    "kv_used": load["num_used_tokens"],
                    "stored": info["summaries_stored"],
                    "held": info["summaries_held"],
                }
            )

    jobs = []
    for index in range(args.requests):
        prompt = rng.choice(shared) if rng.random() < 0.85 else rng.choice(unshared)
        sampled = rng.random() < 0.3
        jobs.append(
            {
                "rid": f"soak-{index:05d}-",
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": rng.randint(4, 32),
                    "temperature": 0.8 if sampled else 0.0,
                    "ignore_eos": True,
                },
                "abort_after_s": rng.uniform(0.5, 8) if rng.random() < 0.05 else None,
                "flush": rng.random() < 0.02,
            }
        )
    outcomes = {"finished": 0, "aborted": 0, "errors": 0, "flushes_accepted": 0, "retracted": 0}
    lock = threading.Lock()

    def send(job: dict) -> None:
        if job["abort_after_s"] is not None:
            threading.Timer(
                job["abort_after_s"],
                lambda: requests.post(
                    f"{server.url}/abort_request", json={"rid": job["rid"]}, timeout=30
                ),
            ).start()
        if job["flush"]:
            flushed = requests.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
            with lock:
                outcomes["flushes_accepted"] += flushed
        payload = {key: job[key] for key in ("rid", "input_ids", "sampling_params")}
        response = requests.post(f"{server.url}/generate", json=payload, timeout=900)
        with lock:
            if response.status_code != 200:
                outcomes["errors"] += 1
                return
            meta = response.json()["meta_info"]
            outcomes["retracted"] += meta.get("num_retractions", 0)
            outcomes["aborted" if meta["finish_reason"]["type"] == "abort" else "finished"] += 1

    sampler = threading.Thread(target=sample, daemon=True)
    started = time.monotonic()
    try:
        sampler.start()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(send, jobs))
        elapsed = time.monotonic() - started
        time.sleep(2)
        for _ in range(60):
            if requests.post(f"{server.url}/flush_cache", timeout=30).status_code == 200:
                break
            time.sleep(1)
        final_load = requests.get(f"{server.url}/v1/loads", timeout=30).json()["loads"][0]
        final_info = magicdec_info(server.url)
    finally:
        done.set()
        server.stop()

    report = summarise(samples, outcomes, elapsed, final_load, final_info, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(report)
    args.out.with_suffix(".json").write_text(json.dumps(samples))
    print(report)


def summarise(samples, outcomes, elapsed, final_load, final_info, args) -> str:
    third = max(1, len(samples) // 3)
    middle = statistics.median(s["rss_mb"] for s in samples[third : 2 * third])
    last = statistics.median(s["rss_mb"] for s in samples[2 * third :])
    checks = {
        "KV in use after the run (tokens)": (final_load["num_used_tokens"], 0),
        "summaries held after the run": (final_info["summaries_held"], 0),
        "failed requests": (outcomes["errors"], 0),
    }
    lines = [
        f"Soak: {args.requests} requests, concurrency {args.concurrency}, "
        f"{elapsed / 60:.1f} min; {outcomes['finished']} finished, {outcomes['aborted']} "
        f"aborted, {outcomes['errors']} failed; {outcomes['retracted']} retractions; "
        f"flush_cache accepted {outcomes['flushes_accepted']} times",
        "",
        f"summaries computed {final_info['summaries_computed']}, reused "
        f"{final_info['summaries_reused']}, dropped {final_info['summaries_dropped']}, stored at "
        f"most {max(s['stored'] for s in samples)} (after the run: "
        f"{final_info['summaries_stored']}); drafts without a summary "
        f"{final_info['drafts_without_summary']}",
        f"KV in use: at most {max(s['kv_used'] for s in samples)} of 8000 tokens",
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
    for name, (value, expected) in checks.items():
        lines.append(f"- {name}: {value} ({'ok' if value == expected else 'LEAK'})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
