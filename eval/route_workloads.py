"""The workloads of `ctxgate bench route`: open-loop schedules of chat requests that share prefixes.

- multi-turn: conversations arriving one after another, each resending its whole history (its
  short system prompt, its earlier turns, canned assistant replies so the schedule does not depend
  on what the model answers) with a new question every `gap_s`;
- rag: one application's long system prompt shared by every request, then passages and a question
  of the request's own.

Every arm of the bench gets the same schedule with its own `tag` at the start of every prompt, so
no arm finds another arm's blocks in the replicas' prefix caches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

TOWNS = (
    "Lakeview",
    "Ashford",
    "Brightwater",
    "Cedar Falls",
    "Dunmore",
    "Elmstead",
    "Fairhaven",
    "Glenrock",
    "Harrow",
    "Ironbridge",
    "Juniper",
    "Kingsbury",
)
TOPICS = (
    "the harbour",
    "the old mill",
    "the railway",
    "the library",
    "the market",
    "the bridge",
    "the school",
    "the festival",
    "the museum",
    "the river",
    "the park",
    "the observatory",
)


@dataclass(frozen=True)
class Item:
    """One request of a schedule: when to send it (seconds from the start) and its messages."""

    at_s: float
    workload: str
    conversation: str
    messages: list[dict[str, Any]]


def _fact(rng: random.Random, town: str) -> str:
    topic = rng.choice(TOPICS)
    year = rng.randint(1820, 2010)
    return (
        f"In {town}, {topic} was built in {year} by {rng.randint(2, 90)} workers, restored in "
        f"{year + rng.randint(5, 60)}, and is visited by about {rng.randint(100, 9000)} people a year. "
        f"Locals say {topic} is best seen in the {rng.choice(('morning', 'evening', 'spring', 'autumn'))}."
    )


def multi_turn(
    tag: str, conversations: int, turns: int, gap_s: float, start_every_s: float, seed: int = 0
) -> list[Item]:
    """`conversations` chats of `turns` turns; conversation c starts at c * start_every_s."""
    rng = random.Random(seed)
    items = []
    for c in range(conversations):
        town = TOWNS[c % len(TOWNS)]
        # A short system prompt and long turns, as in chat: most of a later turn's prompt is the
        # conversation so far, which only the replica that served the previous turn holds.
        system = (
            f"[{tag}] You are the visitor guide of {town}, talking with visitor #{c}. Answer in one short "
            "sentence, using only the facts given."
        )
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for turn in range(turns):
            messages = [
                *messages,
                {"role": "user", "content": f"{_fact(rng, town)} Question {turn}: what year was that built?"},
            ]
            items.append(Item(c * start_every_s + turn * gap_s, "multi-turn", f"c{c}", list(messages)))
            reply = f"It was built in {rng.randint(1820, 2010)}. " + " ".join(
                _fact(rng, town) for _ in range(2)
            )
            messages = [*messages, {"role": "assistant", "content": reply}]
    return sorted(items, key=lambda item: item.at_s)


def rag(tag: str, requests: int, interval_s: float, seed: int = 1) -> list[Item]:
    """`requests` RAG requests with one shared system prompt, one every `interval_s`."""
    rng = random.Random(seed)
    system = (
        f"[{tag}] You answer questions about the towns of the valley from the passages given. Quote the "
        "passage that answers; if none does, say you do not know. "
        + " ".join(_fact(rng, TOWNS[i % len(TOWNS)]) for i in range(4))
    )
    items = []
    for index in range(requests):
        town = TOWNS[rng.randrange(len(TOWNS))]
        passages = "\n".join(f"[{n}] {_fact(rng, town)}" for n in range(2))
        items.append(
            Item(
                index * interval_s,
                "rag",
                f"r{index}",
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Passages:\n{passages}\n\nQuestion: when was it built?"},
                ],
            )
        )
    return items
