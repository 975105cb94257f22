"""Shared-document QA: N questions over one long document, as an SGLang frontend program.

`fork` sends the document on its own first (SGLang's frontend commits the shared text before it
forks), so the server prefills it once, keeps it in the radix cache and, with the SnapKV draft,
computes one summary of it; every question then extends that prompt and reuses both.

    python python/shared_doc_qa.py --base-url http://127.0.0.1:30000 --questions 8

The document text ends on a full stop and each question starts with a space, so the document's
tokens are an exact prefix of every question's prompt (BPE would merge trailing whitespace).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import sglang as sgl

QUESTIONS = [
    "Who is the main character of this text?",
    "Where does the story take place?",
    "Summarise the first paragraph in one sentence.",
    "What is the mood of the last paragraph?",
    "Name two people mentioned in the text.",
    "What happens right at the end?",
    "Which time of day is described?",
    "What is the most surprising detail?",
    "What would a good title be?",
    "Who speaks first?",
    "Give one quote from the text.",
    "What season is it?",
]


@sgl.function
def shared_doc_qa(s, document: str, questions: list[str], max_tokens: int):
    s += "Read the document and answer the questions.\n\nDocument:\n" + document.strip()
    s += "\nEnd of document."
    # `fork` commits the shared text as its own request only if it sees it: it checks before
    # waiting for the queued appends, so wait for them first.
    s.sync()
    forks = s.fork(len(questions))
    for fork, question in zip(forks, questions, strict=True):
        fork += " Question: " + question + "\nAnswer:"
        fork += sgl.gen("answer", max_tokens=max_tokens, temperature=0)
    forks.join()
    s["answers"] = [fork["answer"] for fork in forks]


def run(
    base_url: str,
    document: str,
    num_questions: int = 8,
    max_tokens: int = 16,
    questions: list[str] | None = None,
    ignore_eos: bool = False,
) -> list[str]:
    """Answers to `questions` (default: the first `num_questions` of QUESTIONS, cycled) about
    `document`."""
    if questions is None:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_questions)]
    state = shared_doc_qa.run(
        document=document,
        questions=questions,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,  # a default sampling parameter of every gen in the program
        backend=sgl.RuntimeEndpoint(base_url),
    )
    return state["answers"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--document",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "shared/data/pg19/pg19_4K.jsonl",
        help="a text file, or a .jsonl whose first line has a 'text' field",
    )
    args = parser.parse_args()
    raw = args.document.read_text()
    document = json.loads(raw.splitlines()[0])["text"] if args.document.suffix == ".jsonl" else raw
    for answer in run(args.base_url, document, args.questions, args.max_tokens):
        print(repr(answer))


if __name__ == "__main__":
    main()
