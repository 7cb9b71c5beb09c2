"""Suite strength: the state machine must find every mutant of tqbatch.testing.mutants.

Each mutant re-introduces one plausible bug; a run that passes against one
means the machine would have missed that bug. A mutant counts as found only
by the check it names (``CATCHES``): every other failure is tolerated, so a
policy difference or a side effect cannot stand in for the check that
matters. The verdict must not depend on
luck, so this test does not run under the active Hypothesis profile: it uses
``SEARCH``, derandomized (the same examples on every run and every machine
for a given Hypothesis version) with an example budget far above what each
mutant needs. The golden scenarios kill every mutant with explicit op
sequences (tests/golden/test_golden.py); this test shows the *search* finds
them too.
"""

import pytest
from hypothesis import HealthCheck, Phase, settings

from tqbatch.testing.mutants import MUTANTS, describe
from tqbatch.testing.selfcheck.selftest import hunt

# Budget: measured with these settings (derandomized, 15 steps), each mutant
# counted only by its own check, with the strategies as they were before
# long prompts became rarer: median 4 examples to the kill, worst 172
# (BatchOnePaddingMishandled, which needs B = 1 and a left-padding prepare);
# under the ci profile now, worst 49 (README, "Suite strength"). 1500
# examples leave a margin of ~9x over the worst seen, so a Hypothesis upgrade
# that changes the derandomized draws still finds every mutant. Each run
# stops at its first failure: the budget costs time only for a mutant that
# is not found.
SEARCH = settings(
    max_examples=1500,
    stateful_step_count=15,
    derandomize=True,
    database=None,
    deadline=None,
    # A mutant only has to be found, not minimised (hunt() runs the generate phase).
    phases=[Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_catalogue_is_large_enough():
    assert len(MUTANTS) >= 12, sorted(MUTANTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_machine_kills_mutant(name):
    result = hunt(name, profile=SEARCH)
    assert result.failure is not None, f"{name} ({describe(name)}) was not caught"
    assert result.found, f"{name}: caught by {result.failure.identity}, not by {result.check}"


def test_readme_table_lists_every_mutant_and_its_check():
    """docs/search-speed.md's table (``selfcheck.selftest --markdown``) is current."""
    from pathlib import Path

    from tqbatch.testing.mutants import CATCHES

    readme = (Path(__file__).parents[2] / "docs" / "search-speed.md").read_text()
    block = readme.split("<!-- selftest:start -->")[1].split("<!-- selftest:end -->")[0]
    rows = [line.split("|")[1:3] for line in block.splitlines() if line.startswith("| ")][1:]
    listed = {name.strip(): check.strip() for name, check in rows}
    assert listed == CATCHES, "re-run `python -m tqbatch.testing.selfcheck.selftest --markdown`"
