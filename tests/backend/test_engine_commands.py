"""The engine thread's inbox: mid-step only the adds at its front apply; everything from the first
other command on waits for the step's end, in the order it was sent."""

from __future__ import annotations

import asyncio
import queue

import pytest

from ctxgate.backend.engine.api import GenerationRequest, SamplingParams
from ctxgate.backend.engine.engine_commands import WAKE, Abort, Add, CommandQueue, Stop
from ctxgate.backend.engine.request_stream import RequestStream


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def add(loop, request_id: str) -> Add:
    request = GenerationRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=1))
    return Add(request, RequestStream(request_id, loop, on_close=lambda: None))


def drain(commands: CommandQueue) -> list[object]:
    taken = []
    while True:
        try:
            taken.append(commands.get(block=False))
        except queue.Empty:
            return taken


def test_mid_step_the_adds_before_an_abort_apply_and_the_rest_keeps_its_order(loop):
    commands = CommandQueue()
    first, second, third = add(loop, "a"), add(loop, "b"), add(loop, "c")
    abort, stop = Abort("a", notify=True), Stop()
    for command in (first, WAKE, second, abort, third, stop):
        commands.put(command)
    assert commands.adds_mid_step() == [first, second]  # the wake-up is spent: the thread is awake
    assert commands.adds_mid_step() == []  # the held abort blocks the add behind it
    assert drain(commands) == [abort, third, stop]  # after the step: in the order sent


def test_with_nothing_held_later_adds_apply_mid_step(loop):
    commands = CommandQueue()
    assert commands.adds_mid_step() == []
    commands.put(late := add(loop, "late"))
    assert commands.adds_mid_step() == [late]
    assert drain(commands) == []
