"""A multi-turn agent loop as an SGLang frontend program: a long tool manual is the shared
system prompt, several agents fork from it, and each turn extends its agent's conversation.

Every turn's prompt extends the previous turn's, and every agent's extends the manual's, so the
server prefills the manual once (radix cache) and, with the SnapKV draft, reuses the manual's
summary (or a later turn's) instead of summarising each prompt again.

    python python/agent_loop.py --base-url http://127.0.0.1:30000 --agents 2 --turns 3
"""

from __future__ import annotations

import argparse

import sglang as sgl

TASKS = [
    "Find the cheapest flight from Lisbon to Oslo next Tuesday.",
    "Book a table for four near the central station tonight.",
    "Convert 250 euros to Japanese yen and explain the fee.",
    "Summarise my three most recent unread emails.",
]
FOLLOW_UPS = [
    "The tool returned an error: rate limited. What do you do next?",
    "The tool returned a result. Which tool do you call next, with which arguments?",
    "Now report back to the user in one sentence.",
]


def tool_manual(num_tools: int = 40) -> str:
    """A long, deterministic tool manual (about 60 tokens per tool)."""
    verbs = ["search", "book", "convert", "read", "send", "cancel", "list", "update"]
    nouns = ["flights", "tables", "currency", "emails", "calendar", "files", "tickets", "notes"]
    lines = ["You are an agent that solves tasks by calling tools. Available tools:"]
    for i in range(num_tools):
        verb, noun = verbs[i % len(verbs)], nouns[(i * 3) % len(nouns)]
        lines.append(
            f"Tool {i}: {verb}_{noun}_{i}(query: str, limit: int = {i % 7 + 1}, "
            f"region: str = 'eu-{i % 5}') - {verb.capitalize()}s {noun} matching the query; "
            f"returns at most `limit` items as JSON with fields id, title, score and "
            f"url. Fails with RateLimited after {10 + i} calls per minute; retry after "
            f"{i % 4 + 1} seconds."
        )
    lines.append("Answer with the tool call to make, then one sentence of reasoning.")
    return "\n".join(lines)


@sgl.function
def agent_loop(s, manual: str, tasks: list[str], turns: int, max_tokens: int):
    s += sgl.system(manual)
    # `fork` commits the shared text as its own request only if it sees it: it checks before
    # waiting for the queued appends, so wait for them first.
    s.sync()
    agents = s.fork(len(tasks))
    for agent, task in zip(agents, tasks, strict=True):
        agent += sgl.user(task)
        for turn in range(turns):
            agent += sgl.assistant(sgl.gen(f"turn_{turn}", max_tokens=max_tokens, temperature=0))
            if turn + 1 < turns:
                agent += sgl.user(FOLLOW_UPS[turn % len(FOLLOW_UPS)])
    agents.join()
    s["transcripts"] = [[agent[f"turn_{turn}"] for turn in range(turns)] for agent in agents]


def run(
    base_url: str, num_agents: int = 2, turns: int = 3, max_tokens: int = 16, num_tools: int = 40
) -> list[list[str]]:
    """Each agent's replies, turn by turn."""
    tasks = [TASKS[i % len(TASKS)] for i in range(num_agents)]
    state = agent_loop.run(
        manual=tool_manual(num_tools),
        tasks=tasks,
        turns=turns,
        max_tokens=max_tokens,
        backend=sgl.RuntimeEndpoint(base_url),
    )
    return state["transcripts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    for i, transcript in enumerate(run(args.base_url, args.agents, args.turns, args.max_tokens)):
        for turn, reply in enumerate(transcript):
            print(f"agent {i} turn {turn}: {reply!r}")


if __name__ == "__main__":
    main()
