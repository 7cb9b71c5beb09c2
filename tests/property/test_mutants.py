"""Suite strength: the state machine must kill every mutant of tqbatch.testing.mutants.

Each mutant re-introduces one plausible bug; a run that passes against one
means the harness would have missed that bug. Runs under the active profile;
`nox -s mutants` runs it with `--hypothesis-profile mutation`.
"""

import pytest
from hypothesis import Phase, settings

from tqbatch.testing.mutants import MUTANTS, describe
from tqbatch.testing.stateful import machine_for


def test_catalogue_is_large_enough():
    assert len(MUTANTS) >= 12, sorted(MUTANTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_machine_kills_mutant(name):
    machine = machine_for(MUTANTS[name])
    # A mutant only has to be caught, not minimised: skip shrinking, keep the
    # active profile's example and step budget.
    machine.TestCase.settings = settings(
        settings.default, phases=[Phase.explicit, Phase.reuse, Phase.generate]
    )
    with pytest.raises(Exception):  # noqa: B017 - any failure the machine reports
        machine.TestCase("runTest").runTest()
    # The failure must come from the harness's checks, not from a crash of
    # the harness itself: the machine records every failure it raises.
    assert machine.last_failure is not None, f"{name} ({describe(name)}) was not caught"
