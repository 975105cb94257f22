"""Shared-document QA: one SnapKV summary for all questions vs one per request, on the CPU server.

    .venv/bin/python -m benchmark.bench_shared_doc [--questions 8] [--doc-tokens 3000]

N questions over one long PG-19 document, run by the frontend program python/shared_doc_qa.py
(the document is committed first, then the questions fork and run concurrently). Modes, one
server each, never two at once:
  shared       --magicdec-draft snapkv: the document's summary is computed once and reused
  per-request  the same with --magicdec-share-min-len above the document: every question
               summarises its own prompt (window = the end of its question; each question is
               longer than the window so that it can)
  streaming    --magicdec-draft streaming, for reference
Prints α, decode tokens/s of the question phase, summaries computed and reused.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmark.common import DEFAULT_DATA, RESULTS, load_tokenizer, magicdec_info
from sglang_magicdec.cost_model import alpha_from_accept_length
from sglang_magicdec.server_process import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import shared_doc_qa  # noqa: E402

TOPICS = [
    "the first person who speaks",
    "the place where the scene is set",
    "the weather and the time of day",
    "the feelings of the main character",
    "an object that is described in detail",
    "the last event in the passage",
    "a conflict between two people",
    "a word that sounds old-fashioned",
    "the reason for the journey",
    "what the narrator thinks of the others",
    "the longest conversation",
    "a sound that is mentioned",
]


def long_questions(count: int) -> list[str]:
    """Questions longer than the 32-token observation window, so a per-request summary can
    observe its own window. They differ from their first word on: a common opening would sit in
    the radix cache after the first question and leave the others' new tokens shorter than the
    window (they would draft with StreamingLLM)."""
    return [
        f"As for {TOPICS[i % len(TOPICS)]} (question {i + 1}): please read the document above "
        f"carefully once more and then tell me, in a couple of full sentences and with a short "
        f"quotation where possible, everything the text says about it and why it matters."
        for i in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_doc")
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    with (args.data / "pg19" / "pg19_4K.jsonl").open() as handle:
        text = json.loads(handle.readline())["text"]
    document = tokenizer.decode(tokenizer(text)["input_ids"][: args.doc_tokens])
    # Two more for the warm-up: a measured question must not be in the radix cache already.
    *questions, warm_up_1, warm_up_2 = long_questions(args.questions + 2)
    speculative = [
        "--speculative-algorithm",
        "MAGICDEC",
        "--speculative-num-steps",
        str(args.gamma),
    ]
    modes = {
        "shared": [*speculative, "--magicdec-draft", "snapkv"],
        "per-request": [
            *speculative,
            "--magicdec-draft",
            "snapkv",
            "--magicdec-share-min-len",
            str(10 * args.doc_tokens),
        ],
        "streaming": [*speculative, "--magicdec-draft", "streaming"],
    }
    log_dir = Path(tempfile.mkdtemp(prefix="bench-shared-doc-"))
    rows = []
    for mode, mode_args in modes.items():
        server = start_server(["--dtype", "float32", *mode_args], log_dir)
        try:
            # Warm the document's prefill and summary, as a server that has seen it would be.
            shared_doc_qa.run(server.url, document, questions=[warm_up_1, warm_up_2], max_tokens=1)
            before = magicdec_info(server.url)
            start = time.perf_counter()
            shared_doc_qa.run(
                server.url,
                document,
                questions=questions,
                max_tokens=args.new_tokens,
                ignore_eos=True,
            )
            elapsed = time.perf_counter() - start
            after = magicdec_info(server.url)
        finally:
            server.stop()
        rounds = after["verify_rounds"] - before["verify_rounds"]
        tokens = after["avg_accept_length"] * after["verify_rounds"] - (
            before["avg_accept_length"] * before["verify_rounds"]
        )
        row = {
            "mode": mode,
            "alpha": alpha_from_accept_length(tokens / rounds, args.gamma),
            "tokens_per_s": args.questions * args.new_tokens / elapsed,
            "summaries_computed": after.get("summaries_computed", 0)
            - before.get("summaries_computed", 0),
            "summaries_reused": after.get("summaries_reused", 0)
            - before.get("summaries_reused", 0),
        }
        rows.append(row)
        print(row, flush=True)

    lines = [
        f"{args.questions} questions over one {args.doc_tokens}-token PG-19 document, "
        f"{args.new_tokens} tokens each, γ={args.gamma}, budget 512 (summaries: during the "
        "question phase; the document itself was summarised in the warm-up)",
        "",
        "| mode | α | tokens/s | summaries computed | summaries reused |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['alpha']:.3f} | {row['tokens_per_s']:.1f} | "
            f"{row['summaries_computed']} | {row['summaries_reused']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
