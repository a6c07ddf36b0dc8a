"""What the stage tests share: a request, its pipeline state and stage context, and history shapes."""

from __future__ import annotations

from ctxgate.compression.pipeline import CompressionPipeline
from ctxgate.compression.stages.base import StageContext
from ctxgate.compression.state import PipelineState, split_messages
from ctxgate.compression.types import CompressionInput, Document
from ctxgate.policies.schema import Policy

SYSTEM = {"role": "system", "content": "Answer from the documents."}
QUESTION = {"role": "user", "content": "Which river runs through Lyon?"}
DOCUMENTS = [
    Document(
        text=f"Passage {i} says the Rhone and the Saone meet in Lyon. It is a long river.", title=f"T{i}"
    )
    for i in range(6)
]


def history_turns(turns: int) -> list[dict[str, str]]:
    messages = []
    for turn in range(turns):
        messages += [
            {"role": "user", "content": f"Question number {turn} about French rivers and their towns?"},
            {"role": "assistant", "content": f"Answer {turn}: " + "rivers shape the towns along them. " * 4},
        ]
    return messages


def setup_state(tokenizer, policy: Policy, messages=None, documents=()) -> tuple[PipelineState, StageContext]:
    pipeline = CompressionPipeline(tokenizer)
    request = CompressionInput(messages=messages or [SYSTEM, QUESTION], documents=list(documents))
    state = split_messages(request, budget_tokens=policy.max_input_tokens)
    return state, StageContext(policy=policy, counter=pipeline.counter, services=pipeline.services)


def tool_exchange(turn: int) -> list[dict]:
    call_id = f"call_{turn}"
    return [
        # Content "" as the gateway passes it (m.text() of a null content).
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": "river_length",
                        "arguments": f'{{"river": "Rhone", "turn": {turn}}}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": f"The Rhone is 813 km long (lookup {turn})."},
    ]


def assert_no_broken_exchange(history: list[dict]) -> None:
    """Every tool reply follows its call, every call keeps all its replies."""
    open_calls: set[str] = set()
    for message in history:
        if message["role"] == "tool":
            assert message["tool_call_id"] in open_calls, history
            open_calls.discard(message["tool_call_id"])
        else:
            assert not open_calls, history  # a call lost its reply
            open_calls = {call["id"] for call in message.get("tool_calls") or []}
    assert not open_calls
