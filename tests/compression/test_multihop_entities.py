"""Bridge entities that are no passage's title: the names a first-hop sentence adds to the question."""

from __future__ import annotations

from ctxgate.compression.multihop.entities import entities, new_entities


def test_names_are_capitalised_runs_with_particles_and_no_sentence_openers():
    found = entities(
        "He was an assistant to Ernst Mach at Charles University. The House of Commons met in 1912."
    )
    assert found == ["ernst mach", "charles university", "house of commons"]


def test_a_name_the_question_already_holds_is_not_new():
    question = "Who is the employer of the person Mach's principle was named after?"
    assert new_entities("Mach's principle is named after the physicist Ernst Mach.", question) == [
        "ernst mach"
    ]


def test_entity_scan_is_linear_in_hostile_text():
    import time

    text = ("A" + " " * 50_000 + "x ") * 4 + "Ab " * 20_000
    started = time.perf_counter()
    entities(text)
    assert time.perf_counter() - started < 2.0
