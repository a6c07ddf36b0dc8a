"""Bridge entities that are no passage's title: a first-hop sentence's names point to the passages
that name them too."""

from __future__ import annotations

from compression.multihop.entities import entities, new_entities, passages_naming
from compression.multihop.plan import entity_links
from compression.state import Passage
from compression.types import Document


def _passage(title: str, text: str, position: int) -> Passage:
    return Passage(document=Document(text=text, id=f"p{position}", title=title), position=position)


def test_names_are_capitalised_runs_with_particles_and_no_sentence_openers():
    found = entities("He was an assistant to Ernst Mach at Charles University. The House of Commons met in 1912.")
    assert found == ["ernst mach", "charles university", "house of commons"]


def test_a_name_the_question_already_holds_is_not_new():
    question = "Who is the employer of the person Mach's principle was named after?"
    assert new_entities("Mach's principle is named after the physicist Ernst Mach.", question) == ["ernst mach"]


def test_a_name_links_only_to_the_one_passage_that_names_it():
    question = "Who is the employer of the person Mach's principle was named after?"
    passages = [
        _passage("Mach's principle", "Mach's principle is named after the physicist Ernst Mach.", 0),
        _passage("Vinko Dvořák", "Dvořák was an assistant to Ernst Mach at Charles University.", 1),
        _passage("Prague", "Prague is the capital of the Czech Republic.", 2),
    ]
    assert entity_links(question, passages, passages[0].text, skip={0}) == {1: "ernst mach"}
    assert passages_naming("ernst mach", [p.text for p in passages], skip={0}) == [1]
    # Named by two other passages: a topic of the request, not a link to one of them.
    passages.append(_passage("Physics", "Ernst Mach studied shock waves.", 3))
    assert entity_links(question, passages, passages[0].text, skip={0}) == {}


def test_entity_scan_is_linear_in_hostile_text():
    import time

    text = ("A" + " " * 50_000 + "x ") * 4 + "Ab " * 20_000
    started = time.perf_counter()
    entities(text)
    assert time.perf_counter() - started < 2.0
