"""Known-failures files (``tqbatch.testing.gate.known_failures``): the format, a run judged by one.

Each rule of the format is shown refusing a purpose-built bad file, naming
the line; the triage is shown on each of its three outcomes.
"""

from __future__ import annotations

import pytest

from tqbatch.testing.gate.known_failures import (
    SHIPPED_DIR,
    KnownFailures,
    KnownFailuresError,
    Triage,
    format_known_failures,
    shipped,
)

GOOD = """\
# mlx-vlm's class, 40 examples

size              # size() is the capacity
offset@roundtrip  # meta_state keeps one offset # and this is still the reason
   rejects@trim-negative#trims from the end
"""


def test_a_file_lists_identities_with_their_reasons(tmp_path):
    path = tmp_path / "known.txt"
    path.write_text(GOOD)
    known = KnownFailures.load(path)
    assert known.entries == {
        "size": "size() is the capacity",
        "offset@roundtrip": "meta_state keeps one offset # and this is still the reason",
        "rejects@trim-negative": "trims from the end",
    }
    assert len(known) == 3
    assert KnownFailures.empty().entries == {}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("size\n", r"known\.txt:1: 'size' has no reason"),
        ("# comment\n\nsize   #   \n", r"known\.txt:3: 'size' has no reason"),
        ("size # ok\nsize@update # again\nsize # twice\n", r"known\.txt:3: 'size' is listed twice"),
        ("siez@update # a typo\n", r"known\.txt:1: 'siez@update' is not a failure identity"),
    ],
)
def test_a_line_without_a_reason_or_not_a_failure_is_an_error_naming_it(tmp_path, text, error):
    path = tmp_path / "known.txt"
    path.write_text(text)
    with pytest.raises(KnownFailuresError, match=error):
        KnownFailures.load(path)


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(KnownFailuresError, match="cannot read"):
        KnownFailures.load(tmp_path / "nope.txt")
    assert issubclass(KnownFailuresError, ValueError)


def test_judge_splits_known_new_and_fixed():
    known = KnownFailures({"size": "r", "offset@roundtrip": "r", "rejects@trim-negative": "r"})
    triage = known.triage(["structure", "size", "size", "rejects@trim-negative"])
    assert triage == Triage(
        known=["size", "rejects@trim-negative"], new=["structure"], fixed=["offset@roundtrip"]
    )
    assert not triage.ok and not triage.strict_ok
    only_fixed = known.triage(["size", "rejects@trim-negative"])
    assert only_fixed.ok and not only_fixed.strict_ok  # fixed fails only a strict run
    assert known.triage(known.entries).strict_ok
    assert KnownFailures.empty().triage(["size"]).new == ["size"]


def test_a_written_list_loads_back_and_merges():
    text = format_known_failures(
        [("structure", "unreviewed: the cache has an `_idx` # attribute"), ("size", "")],
        header=["generated"],
    )
    assert text.startswith("# generated\n")
    known = KnownFailures.parse(text)
    assert known.entries == {
        "structure": "unreviewed: the cache has an `_idx` # attribute",
        "size": "-",
    }
    merged = known.merged(KnownFailures({"size": "why", "content@extend": "why"}))
    assert merged.entries["size"] == "why" and len(merged) == 3


def test_the_shipped_lists_load():
    files = sorted(SHIPPED_DIR.glob("*.txt"))
    assert files, SHIPPED_DIR
    for path in files:
        assert KnownFailures.load(path).entries, path
        assert shipped(path.stem) == path == shipped(path.name)
    assert shipped("no_such_list") is None and shipped("../README") is None


def test_the_shipped_lists_give_a_reviewed_reason_for_every_failure():
    # A generated list marks each reason "unreviewed:" (what the check saw);
    # a list tqbatch ships says why each failure is known.
    for path in sorted(SHIPPED_DIR.glob("*.txt")):
        for identity, reason in KnownFailures.load(path).entries.items():
            assert reason not in ("", "-") and not reason.startswith("unreviewed"), (
                path.name,
                identity,
            )
