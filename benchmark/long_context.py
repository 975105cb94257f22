"""Long context with the 32K Qwen model: questions over documents of 16K-32K tokens, AR against
MagicDec (fixed γ, γ = auto, StreamingLLM, other SnapKV budgets), each server in turn, bf16 by
default.

    python -m benchmark.long_context                       # 8 questions over one ~32K document
    python -m benchmark.long_context --context 16000 --documents 4 --questions 4
    python -m benchmark.long_context --context 16000 --modes ar,fixed --budgets 256,1024,2048
    python -m benchmark.long_context --table results.json  # reprint a saved run's table
    python -m benchmark.long_context --context 16000 --modes ar,fixed,auto --dtype float32 \
        --sampling '{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}'
                                                           # at Qwen's published sampling
    python -m benchmark.long_context --context 8000 --modes ar,auto --repeats 3 --turns 2 ...
                                                           # servers past their first batch,
                                                           # AR and γ = auto taking turns

Each document carries a needle sentence at 3/5 of its length; the first question over it asks
for the needle. Per server: the documents are prefilled first, one request each (the time is
reported, not part of decode), then each question's own tokens alone (timed apart), then every
question at once (`ignore_eos`, greedy unless `--sampling`): decode tok/s is the new tokens
over that batch's wall time, and the accept length is tokens per request round of the
speculative rounds alone (γ = auto's plain steps are not rounds). Greedy, every MagicDec mode's
outputs are compared with AR's token for token (the same ragged batch, so bf16 greedy output
must be identical). The AR floor is the
tok/s of an autoregressive decoder that reads the weights a step reads and every request's KV at
the read bandwidth measured before the servers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmark.common import DEFAULT_DATA, accept_length_between, magicdec_info, run_batch
from benchmark.floors import ModelShape, ar_floor_tok_s, measure_machine
from benchmark.server_process import start_server
from sglang_magicdec.model import QWEN_CODER, embedded_model_path

NEEDLE = " The secret password is violet-harbor-42. Remember it. "
NEEDLE_ANSWER = "violet-harbor-42"
QUESTIONS = [
    "What is the secret password mentioned in the text above? Answer with it only.",
    "Summarise the text above in three sentences.",
    "Who is the main character of the text above?",
    "Where does the story above take place?",
    "What happens at the end of the text above?",
    "List three objects that appear in the text above.",
    "What is the mood of the text above?",
    "Which character speaks first in the text above?",
]
MODES = {
    "ar": [],
    "fixed": ["--speculative-algorithm", "MAGICDEC", "--magicdec-gamma", "3"],
    "auto": ["--speculative-algorithm", "MAGICDEC", "--magicdec-gamma", "auto"],
    "streaming": ["--speculative-algorithm", "MAGICDEC", "--magicdec-gamma", "3",
                  "--magicdec-draft", "streaming"],
}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    documents: list[list[int]]  # token ids of each document's chat prompt up to its question
    prompts: list[list[int]]  # each question over its document (question i: document i % D)


def build_workload(context: int, documents: int, questions: int, data: Path) -> Workload:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path(QWEN_CODER))
    texts = [json.loads(line)["text"] for line in (data / "pg19" / "pg19_32K.jsonl").open()]
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": "\x00DOC\x00QUESTION"}], tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    before, after = template.split("\x00DOC\x00")
    head = tokenizer(before, add_special_tokens=False)["input_ids"]
    needle = tokenizer(NEEDLE, add_special_tokens=False)["input_ids"]
    needle_at = context * 3 // 5
    docs = []
    for d in range(documents):
        # books joined where one is shorter than the context
        book: list[int] = []
        for text in texts[2 * d :]:
            book += tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(book) >= context:
                break
        body = book[:needle_at] + needle + book[needle_at : context - len(needle)]
        docs.append(head + body)
    prompts = []
    for q in range(questions):
        tail = "\n\n" + after.replace("QUESTION", QUESTIONS[q % len(QUESTIONS)])
        prompts.append(docs[q % documents] + tokenizer(tail, add_special_tokens=False)["input_ids"])
    return Workload(docs, prompts)


def mode_flags(mode: str) -> list[str]:
    """A named mode, or `budget=N`: fixed γ = 3 with a SnapKV budget of N."""
    if mode.startswith("budget="):
        return [*MODES["fixed"], "--magicdec-budget", mode.removeprefix("budget=")]
    return MODES[mode]


def run_mode(mode: str, args, workload: Workload, log_dir: Path) -> tuple[dict, list[dict]]:
    pool_tokens = (
        sum(len(p) for p in workload.prompts)
        + len(workload.prompts) * (args.new_tokens + 16) * args.repeats
    )
    server = start_server(
        [*mode_flags(mode), "--dtype", args.dtype, "--max-total-tokens", str(pool_tokens),
         "--mem-fraction-static", "0.6"],
        log_dir, timeout_s=900, model=QWEN_CODER.name,
    )  # fmt: skip
    try:
        start = time.perf_counter()
        for document in workload.documents:
            run_batch(server, [document], 1)
        prefill_s = time.perf_counter() - start
        before = magicdec_info(server.url)
        # Each question's own tokens prefilled alone, so that every server computes the same
        # prefill bits (a prefill's bits depend on which prompts SGLang groups into one prefill
        # batch); the batch below then extends one token per request and decodes.
        start = time.perf_counter()
        for prompt in workload.prompts:
            run_batch(server, [prompt], 1)
        questions_prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        results = run_batch(server, workload.prompts, args.new_tokens, args.sampling)
        decode_s = time.perf_counter() - start
        after = magicdec_info(server.url)
        repeat_tok_s = []
        for _ in range(args.repeats - 1):
            start = time.perf_counter()
            repeated = run_batch(server, workload.prompts, args.new_tokens, args.sampling)
            tokens = sum(r["meta_info"]["completion_tokens"] for r in repeated)
            repeat_tok_s.append(tokens / (time.perf_counter() - start))
    finally:
        server.stop()
    new_tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    row = {
        "prefill_s": prefill_s,
        "questions_prefill_s": questions_prefill_s,
        "decode_s": decode_s,
        "decode_tok_s": new_tokens / decode_s,
        "accept_length": accept_length_between(before, after) if after else None,
        "needle_answers": [r["text"] for r in results[:: len(QUESTIONS)]],
    }
    if repeat_tok_s:
        row["repeat_tok_s"] = repeat_tok_s
    for key in ("summaries_computed", "summaries_reused"):
        if key in after:
            row[key] = after[key] - before.get(key, 0)
    for key in ("current_gamma", "predicted_speedup", "gamma_reason"):
        if key in after:  # γ = auto's latest decision
            row[key] = after[key]
    return row, results


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The index of the first token where two outputs differ (None where they are equal)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)


def ar_floor(workload: Workload, dtype: str, bandwidth: float) -> float:
    """The AR floor (`floors.ar_floor_tok_s`) of the workload's prompts, each at its length."""
    model = ModelShape.of(embedded_model_path(QWEN_CODER))
    return ar_floor_tok_s(model, dtype, [len(prompt) for prompt in workload.prompts], bandwidth)


def table(rows: dict[str, dict], floor_tok_s: float, prompts: int) -> str:
    """The Markdown table of one run's rows (also rebuilt from a saved JSON by `--table`)."""
    ar = rows.get("ar", {}).get("decode_tok_s")
    # --repeats: the median of each server's later batches, past its first.
    later = {mode: statistics.median(row["repeat_tok_s"]) for mode, row in rows.items()
             if row.get("repeat_tok_s")}  # fmt: skip
    lines = [
        "| mode | prefill s | decode tok/s | × AR | / AR floor | accept length | summaries "
        "computed / reused | greedy = AR | needle answered |"
        + (" later batches tok/s (× AR) |" if later else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if later else ""),
    ]
    for mode, row in rows.items():
        speedup = f"{row['decode_tok_s'] / ar:.2f}" if ar else "-"
        accept = f"{row['accept_length']:.2f}" if row["accept_length"] else "-"
        shared = (
            f"{row['summaries_computed']} / {row['summaries_reused']}"
            if "summaries_computed" in row else "-"
        )  # fmt: skip
        identical = f"{row['identical_to_ar']} of {prompts}" if "identical_to_ar" in row else "-"
        # The model capitalises the password when it opens its answer with it.
        needles = sum(NEEDLE_ANSWER in text.lower() for text in row["needle_answers"])
        lines.append(
            f"| {mode} | {row['prefill_s']:.0f} | {row['decode_tok_s']:.1f} | {speedup} | "
            f"{row['decode_tok_s'] / floor_tok_s:.2f} | {accept} | {shared} | {identical} | "
            f"{needles} of {len(row['needle_answers'])} |"
        )
        if later:
            cell = f"{later[mode]:.1f}" if mode in later else "-"
            if mode in later and "ar" in later:
                cell += f" ({later[mode] / later['ar']:.2f})"
            lines[-1] += f" {cell} |"
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32_000, help="document tokens")
    parser.add_argument("--documents", type=int, default=1)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--turns", type=int, default=1, help="run the servers this many times, taking turns"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="decode the question batch this many times per server; the later batches' tok/s "
        "(a server past its first batch: γ = auto calibrated) is a column of its own",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--modes", default="ar,fixed,auto,streaming", help=", ".join(MODES))
    parser.add_argument(
        "--budgets", default="", help="comma-separated SnapKV budgets, each a fixed γ = 3 mode"
    )
    parser.add_argument(
        "--sampling",
        type=json.loads,
        help="the questions' sampling parameters as JSON (default greedy; outputs are then not "
        "compared with AR's)",
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", type=Path, help="print the table of a saved --out JSON and exit")
    args = parser.parse_args(argv)
    if args.table:
        saved = json.loads(args.table.read_text())
        prompts = int(saved["args"]["questions"])
        print(table(saved["modes"], saved["ar_floor_tok_s"], prompts))
        before, after = saved["bandwidth_gb_s"]
        print(f"\nread bandwidth before / after the servers: {before:.1f} / {after:.1f} GB/s")
        return

    workload = build_workload(args.context, args.documents, args.questions, args.data)
    machine = measure_machine()
    floor_tok_s = ar_floor(workload, args.dtype, machine.bandwidth)
    print(
        f"{QWEN_CODER.served_name}, {args.dtype}: {args.questions} questions over "
        f"{args.documents} document(s) of {args.context} tokens, {args.new_tokens} new tokens "
        f"{'sampled at ' + json.dumps(args.sampling) if args.sampling else 'greedy'}; "
        f"read {machine.bandwidth / 1e9:.1f} GB/s: AR floor {floor_tok_s:.1f} tok/s",
        flush=True,
    )
    modes = args.modes.split(",") + [f"budget={b}" for b in args.budgets.split(",") if b]
    # --turns: the servers again in the same order, named "ar #2", "auto #2", ...
    modes += [f"{mode} #{turn}" for turn in range(2, args.turns + 1) for mode in modes]
    rows: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for mode in modes:
            rows[mode], results = run_mode(mode.split(" #")[0], args, workload, Path(log_dir))
            outputs[mode] = [r["output_ids"] for r in results]
            if mode != "ar" and "ar" in outputs and args.sampling is None:
                pairs = list(zip(outputs[mode], outputs["ar"], strict=True))
                rows[mode]["identical_to_ar"] = sum(mine == plain for mine, plain in pairs)
                rows[mode]["first_difference"] = [first_difference(*pair) for pair in pairs]
            print(mode, json.dumps(rows[mode]), flush=True)
    after = measure_machine()
    print("\n" + table(rows, floor_tok_s, len(workload.prompts)))
    print(f"\nread bandwidth after the servers: {after.bandwidth / 1e9:.1f} GB/s")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "bandwidth_gb_s": [machine.bandwidth / 1e9, after.bandwidth / 1e9],
                    "ar_floor_tok_s": floor_tok_s,
                    "modes": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
