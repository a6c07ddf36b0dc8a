import unicodedata

from ctxgate.compression.text import normalize_for_dedup


def test_accents_case_punctuation_and_spacing_do_not_make_a_text_new():
    assert normalize_for_dedup("Café  Müller, Zürich!") == "cafe muller zurich"
    assert (
        normalize_for_dedup("Cafe\u0301 Mu\u0308ller Zu\u0308rich") == "cafe muller zurich"
    )  # decomposed input
    assert normalize_for_dedup("Ångström   (1814–1874)") == "angstrom 1814 1874"


def test_every_combining_mark_is_removed_and_nothing_else():
    # Compared with the definition itself: drop the characters whose combining class is not 0.
    text = "".join(chr(code) for code in range(0x00C0, 0x0250)) + " x\u0301\u0323\u20d7 \u0915\u093f"
    decomposed = unicodedata.normalize("NFKD", text)
    expected = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    assert normalize_for_dedup(text) == normalize_for_dedup(expected)
    assert not any(unicodedata.combining(ch) for ch in normalize_for_dedup(text))
