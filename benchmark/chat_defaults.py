"""Twenty factual chat questions with known answers, sent through the OpenAI API as a user would:
no sampling parameters, so the model's published defaults apply (`--sampling-defaults model`).
AR and MagicDec (as `make serve` runs it) on the served Qwen model, one server at a time.

    .venv/bin/python -m benchmark.chat_defaults                  # model defaults, 1 sample each
    .venv/bin/python -m benchmark.chat_defaults --samples 3 --sampling-defaults openai
    .venv/bin/python -m benchmark.chat_defaults --greedy         # temperature 0

Prints, per server, how many answers contain the expected answer (case-insensitive), with the
accept length MagicDec reached, and each wrong answer.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmark.common import magicdec_info
from benchmark.server_process import start_server
from sglang_magicdec.model import QWEN_CODER

# (question, a regular expression the right answer matches)
QUESTIONS = [
    ("What is the capital of France?", r"paris"),
    ("What is the capital of Japan?", r"tokyo"),
    ("What is the capital of Italy?", r"rome"),
    ("What is the capital of Canada?", r"ottawa"),
    ("What is the capital of Australia?", r"canberra"),
    ("What is the capital of Germany?", r"berlin"),
    ("What is the capital of Spain?", r"madrid"),
    ("What is the capital of Egypt?", r"cairo"),
    ("What is 7 times 8?", r"\b56\b"),
    ("What is 15 plus 27?", r"\b42\b"),
    ("What is 100 minus 37?", r"\b63\b"),
    ("What is 144 divided by 12?", r"\b12\b"),
    ("What is the square root of 81?", r"\b9\b|\bnine\b"),
    ("How many days are in a week?", r"\b7\b|\bseven\b"),
    ("What is the chemical symbol for gold?", r"\bau\b"),
    ("What is the largest ocean on Earth?", r"pacific"),
    ("What color is the sky on a clear day?", r"blue"),
    ("Which planet is known as the Red Planet?", r"mars"),
    ("Write a Python expression that reverses the string s.", r"s\[::-1\]|reversed\(s\)"),
    ("Which Python built-in function returns the length of a list?", r"\blen\b"),
]
SERVERS = {
    "AR": [],
    "MagicDec": ["--speculative-algorithm", "MAGICDEC"],
}


def ask(url: str, question: str, max_tokens: int, greedy: bool) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": f"{question} Answer in one short sentence."}],
        max_tokens=max_tokens,
        **({"temperature": 0} if greedy else {}),
    )
    return reply.choices[0].message.content or ""


def run_server(name: str, args, log_dir: Path) -> dict:
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = [*SERVERS[name], "--sampling-defaults", args.sampling_defaults]
    server = start_server(flags, log_dir, timeout_s=900, model=QWEN_CODER.name)
    try:
        asked = [q for q, _ in QUESTIONS for _ in range(args.samples)]
        with ThreadPoolExecutor(len(asked)) as pool:
            answers = list(
                pool.map(lambda q: ask(server.url, q, args.max_tokens, args.greedy), asked)
            )
        info = magicdec_info(server.url)
    finally:
        server.stop()
    expected = [pattern for _, pattern in QUESTIONS for _ in range(args.samples)]
    right = [bool(re.search(p, a, re.IGNORECASE)) for p, a in zip(expected, answers, strict=True)]
    return {
        "right": sum(right),
        "asked": len(asked),
        "accept_length": info.get("avg_accept_length"),
        "wrong": [(q, a) for q, a, ok in zip(asked, answers, right, strict=True) if not ok],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1, help="answers per question")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sampling-defaults", choices=["model", "openai"], default="model")
    parser.add_argument(
        "--greedy", action="store_true", help="temperature 0 (the defaults fill the rest)"
    )
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="chat-defaults-"))
    results = {name: run_server(name, args, work / name) for name in SERVERS}
    print(
        f"{QWEN_CODER.served_name}, {len(QUESTIONS)} questions x {args.samples}, "
        f"--sampling-defaults {args.sampling_defaults}{', greedy' if args.greedy else ''}, "
        f"max {args.max_tokens} tokens\n"
    )
    print("| server | right | accept length |\n|---|---|---|")
    for name, result in results.items():
        accept = result["accept_length"]
        accept_text = "-" if accept is None else f"{accept:.2f}"
        print(f"| {name} | {result['right']} / {result['asked']} | {accept_text} |")
    for name, result in results.items():
        for question, answer in result["wrong"]:
            print(f"{name} wrong: {question!r} -> {answer!r}")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                        "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
