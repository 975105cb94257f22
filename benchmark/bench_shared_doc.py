"""Shared-prefix workloads on the CPU server: summaries computed per shared prefix, and α.

    .venv/bin/python -m benchmark.bench_shared_doc [--workloads raw fork bench-serving]
        [--budgets 256 512 1024] [--modes shared per-request streaming] [--docs 4]

Workloads (greedy; questions about long documents, different questions per document):
  raw            per document, its questions sent at once to /generate as document + question:
                 no fork and no document sent alone first, as OpenAI-style clients send them
  fork           the frontend program python/shared_doc_qa.py (the document is committed first,
                 then the questions fork)
  bench-serving  SGLang's own `bench_serving --dataset-name generated-shared-prefix`
                 (2 groups × 4 prompts, 1,500-token system prompt, 64-token questions)
Modes, one server each, never two at once:
  shared       SnapKV; a summary is computed once per shared prefix and reused
  per-request  SnapKV with --magicdec-share-min-len above every prompt: each request scores
               its own prompt with its own question's window
  streaming    StreamingLLM at the same budget
Documents: BookSum chapters (no test uses them), cut to --doc-tokens. Prints and writes, per
(workload, budget, mode): α, summaries computed / reused, drafts without a summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmark.common import (
    DEFAULT_DATA,
    RESULTS,
    accept_length_between,
    load_tokenizer,
    magicdec_info,
)
from benchmark.server_process import ServerProcess, start_server
from sglang_magicdec.cost_model import alpha_from_accept_length
from sglang_magicdec.model import SMOLLM2, embedded_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import shared_doc_qa  # noqa: E402

QUESTIONS = shared_doc_qa.QUESTIONS
COUNTERS = ("summaries_computed", "summaries_reused", "drafts_without_summary")


def load_documents(data: Path, count: int, doc_tokens: int, tokenizer) -> list[str]:
    """`count` distinct BookSum chapters (the file repeats a chapter once per reference
    summary) without their instruction, cut to `doc_tokens` tokens, ending on a full stop."""
    chapters: dict[str, None] = {}
    with (data / "booksum" / "booksum_4096.jsonl").open() as handle:
        for line in handle:
            chapters[json.loads(line)["text"].split("### Text:", 1)[-1].strip()] = None
    documents = []
    for text in list(chapters)[:count]:
        text = tokenizer.decode(tokenizer(text)["input_ids"][:doc_tokens])
        documents.append(text[: text.rfind(".") + 1])
    return documents


def raw_prompts(document: str, questions: int, tokenizer) -> list[list[int]]:
    """The fork program's prompt text, sent whole: document + one question each."""
    head = "Read the document and answer the questions.\n\nDocument:\n" + document.strip()
    return [
        tokenizer(f"{head}\nEnd of document. Question: {question}\nAnswer:")["input_ids"]
        for question in QUESTIONS[:questions]
    ]


def run_raw(server: ServerProcess, documents, questions: int, new_tokens: int, tokenizer):
    sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    results = []
    for document in documents:
        prompts = raw_prompts(document, questions, tokenizer)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results += pool.map(
                lambda ids: server.generate({"input_ids": ids, "sampling_params": sampling}),
                prompts,
            )
    return results


def run_fork(server: ServerProcess, documents, questions: int, new_tokens: int, _):
    for document in documents:
        shared_doc_qa.run(server.url, document, questions, max_tokens=new_tokens, ignore_eos=True)


def run_bench_serving(server: ServerProcess, *_):
    command = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
        "--base-url", server.url, "--tokenizer", str(embedded_model_path(SMOLLM2)),
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2",
        "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "1500",
        "--gsp-question-len", "64", "--gsp-output-len", "32", "--num-prompts", "8",
        "--seed", "0", "--disable-tqdm",
        "--output-file", str(Path(tempfile.mkdtemp()) / "bench_serving.jsonl"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"bench_serving failed: {done.stderr[-2000:]}")


WORKLOADS = {"raw": run_raw, "fork": run_fork, "bench-serving": run_bench_serving}


def mode_args(mode: str, budget: int, gamma: int) -> list[str]:
    args = ["--speculative-algorithm", "MAGICDEC", "--speculative-num-steps", str(gamma)]
    args += ["--magicdec-budget", str(budget)]
    if mode == "streaming":
        return [*args, "--magicdec-draft", "streaming"]
    args += ["--magicdec-draft", "snapkv"]
    if mode == "per-request":
        args += ["--magicdec-share-min-len", "1000000"]
    return args


def measure(workload: str, budget: int, mode: str, args, documents, tokenizer, log_dir) -> dict:
    server = start_server(["--dtype", "float32", *mode_args(mode, budget, args.gamma)], log_dir)
    try:
        before = magicdec_info(server.url)
        WORKLOADS[workload](server, documents, args.questions, args.new_tokens, tokenizer)
        after = magicdec_info(server.url)
    finally:
        server.stop()
    row = {"workload": workload, "budget": budget, "mode": mode}
    row["alpha"] = alpha_from_accept_length(accept_length_between(before, after), args.gamma)
    row.update({key: after.get(key, 0) - before.get(key, 0) for key in COUNTERS})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["raw"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument(
        "--modes", nargs="+", default=["shared", "per-request", "streaming"],
        choices=["shared", "per-request", "streaming"],
    )  # fmt: skip
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--questions", type=int, default=4, help="per document")
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_doc")
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    documents = load_documents(args.data, args.docs, args.doc_tokens, tokenizer)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-shared-doc-"))
    rows = []
    for workload in args.workloads:
        for budget in args.budgets:
            for mode in args.modes:
                rows.append(measure(workload, budget, mode, args, documents, tokenizer, log_dir))
                print(json.dumps(rows[-1]), flush=True)

    lines = [
        f"{args.docs} BookSum documents of ~{args.doc_tokens} tokens × {args.questions} "
        f"questions (raw, fork) / bench_serving's generated-shared-prefix, greedy, "
        f"{args.new_tokens} tokens (bench_serving: 32), γ = {args.gamma}",
        "",
        "| workload | budget | mode | α | summaries computed | reused | without summary |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['workload']} | {row['budget']} | {row['mode']} | {row['alpha']:.3f} | "
            f"{row['summaries_computed']} | {row['summaries_reused']} | "
            f"{row['drafts_without_summary']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
