"""Property-machine campaigns: the engine behind ``tqbatch fuzz``.

A campaign runs ``tqbatch.testing.search.stateful``'s machine against a target in
rounds (each a Hypothesis run of a few examples under its own seed) until an
example budget or a time budget is spent.

- A plain campaign stops at the first failure and shrinks it.
- A *survey* keeps going: every distinct failing check (``identity``:
  check@op, see ``tqbatch.testing.contract.checks``) is shrunk and kept with its own
  op sequence. A round stops at its first failure and shrinks only that one,
  so that each failure is reported as soon as it is shrunk (``on_example``);
  in later rounds, failures already kept are tolerated (the
  example runs past them, or goes on with a fresh cache where the target
  has diverged), so the search moves on to what else is wrong. The other checks that failed
  after the same op as a failure found (``also``) are kept too, each with
  its own op sequence: the found one's, with what comes before it
  tolerated, cut down op by op (``tqbatch.testing.search.minimize``).
- A survey may end soon after its last find (``quiet_rounds``; the
  plugin's default is ``tqbatch.testing.gate.plugin.QUIET_ROUNDS``): once it
  has found a contract failure, it stops after that many generating rounds
  in a row find no new failing check, and at the latest after twice the
  round of its first find plus that many (``quiet_stop``, decided by
  ``quiet_stop_round`` on the contract failures known after each round);
  a survey that finds none, or only policy differences, runs its whole
  budget.
- Failures already known steer the search instead of ending it: where a
  tolerated failure leaves the target diverged, the example goes on with a
  fresh cache (``tqbatch.testing.search.stateful``), and bad-input cases whose
  known failure diverges are not drawn. ``listed`` identities (a
  known-failures list) are tolerated from the first example on: they are
  not shrunk nor reported as failures, only noted where seen
  (``listed_seen``), and do not count as finds.

Counts are honest: ``examples`` are the examples Hypothesis generated;
``shrink_runs`` the test runs it spent shrinking and replaying failures
(those that passed: a failing run ends before it is counted); op counts
cover generated examples only.

Shrinking is bounded by test runs, never by seconds, so that what a
campaign reports (which failure, shrunk how far, and in a survey what it
goes on to find) is the same on a fast machine and a slow one: Hypothesis
shrinks each round for at most ``SHRINK_RUNS`` runs (``shrink_budget``), then
``tqbatch.testing.search.minimize`` drops single ops from each failure for at most
``MINIMIZE_REPLAYS`` replays. A failure not yet minimal by then is reported
as far as it got.

Campaigns share what they find through a Hypothesis example database
(``database``: an ``ExampleDatabase`` or a spec for
``tqbatch.testing.search.databases.open_database``). Hypothesis saves every failure
it finds there; a campaign's first round replays every saved example
(Hypothesis's reuse phase) and generates nothing, reporting every saved
failure that still fails, and later rounds generate; ``replay_only`` runs
the first round only. ``replayed`` counts those runs, and each failure's
``replayed`` says whether it was found while replaying. The examples of a
campaign are saved under ``campaign_key``: the target and the switches that
decide whether a saved example still fails.

What of Hypothesis's internals this needs (the engine's clock, observability,
the database key) is ``tqbatch.testing.search.hypothesis_internals``.
"""

from __future__ import annotations

import json
import time
import unittest
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Unsatisfiable

from tqbatch.testing.backend.codebooks import fast_codebooks
from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.contract.ops import CHECKS
from tqbatch.testing.search import hypothesis_internals
from tqbatch.testing.search.hypothesis_internals import RunClock, shrink_budget
from tqbatch.testing.search.machine_observer import MachineObserver
from tqbatch.testing.search.minimize import minimize
from tqbatch.testing.search.profiles import register_profiles
from tqbatch.testing.search.stateful import UnsupportedOpsWarning, machine_for
from tqbatch.testing.target import impl_spec

__all__ = [
    "ROUND_EXAMPLES",
    "MINIMIZE_REPLAYS",
    "SHRINK_RUNS",
    "CampaignResult",
    "campaign_key",
    "conforms",
    "contract_identities",
    "quiet_stop_round",
    "run_campaign",
    "save_failures",
    "survey_test_case",
]

ROUND_EXAMPLES = 5  # examples per Hypothesis run: the budgets are checked between runs
# Per failure, in test runs (passing and failing). Hypothesis's shrinker works
# on the choices the state machine drew, and most of its candidates no longer
# line up with the rules they were drawn for (346 of 400 runs, shrinking a
# prepare failure); the op-level pass after it (``minimize``, one replay per
# op left) cuts the op list itself. On the 27 mutants of the catalogue, 100
# runs and that pass give repros of 75 ops in all (5 at most), 400 runs gave
# 73 (5 at most) for four times the runs: a survey that shrinks seven finds
# spent 135 of its 142 s shrinking at 400.
SHRINK_RUNS = 100
MINIMIZE_REPLAYS = 100


@dataclass
class CampaignResult:
    """What a campaign found and what it ran.

    ``failures``: ``tqbatch.testing.contract.failure.Failure`` records, one
    per identity, in the order found, each with the identities tolerated
    when it was found and whether it was found replaying the example
    database. ``replayed``: test runs of saved examples replayed from the
    database (not counted in ``examples``).
    ``shards``: per-shard summaries of a ``--workers`` campaign.
    """

    examples: int = 0
    shrink_runs: int = 0
    op_counts: dict = field(default_factory=dict)
    pair_counts: dict = field(default_factory=dict)
    # Tokens whose reference took the target's other rounding choice of a
    # code or norm (tqbatch.testing.oracles.rounding), over generated examples.
    rounding_admitted: int = 0
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0
    rounds: int = 0
    exhausted: bool = False  # every example ended in a known failure: nothing more to find
    shards: list = field(default_factory=list)
    replayed: int = 0
    # Listed identities (``run_campaign(listed=...)``) seen failing, tolerated:
    # records of identity, level and what failed, in the order first seen.
    listed_seen: list[Failure] = field(default_factory=list)
    quiet_stop: bool = False  # stopped for quiet after its last find (``quiet_rounds``)

    @property
    def failure(self) -> Failure | None:
        """The first failure (a plain campaign has at most one, or one per saved failure it
        replayed)."""
        return self.failures[0] if self.failures else None

    def absorb(self, other: CampaignResult):
        """Add a shard's result: counts add up; a failure per identity, the shortest kept."""
        self.examples += other.examples
        self.shrink_runs += other.shrink_runs
        self.replayed += other.replayed
        self.rounds += other.rounds
        self.rounding_admitted += other.rounding_admitted
        for name, n in other.op_counts.items():
            self.op_counts[name] = self.op_counts.get(name, 0) + n
        for pair, n in other.pair_counts.items():
            self.pair_counts[pair] = self.pair_counts.get(pair, 0) + n
        by_key = {f.key: i for i, f in enumerate(self.failures)}
        for failure in other.failures:
            i = by_key.get(failure.key)
            if i is None:
                by_key[failure.key] = len(self.failures)
                self.failures.append(failure)
            elif len(failure.ops or ()) < len(self.failures[i].ops or ()):
                self.failures[i] = failure
        seen = {f.identity for f in self.listed_seen}
        self.listed_seen += [f for f in other.listed_seen if f.identity not in seen]
        self.seconds = max(self.seconds, other.seconds)
        self.exhausted = self.exhausted or other.exhausted
        self.quiet_stop = self.quiet_stop or other.quiet_stop

    def outcome(self) -> dict:
        """What a rerun of the same campaign must reproduce, whatever its speed: examples,
        op and op-pair counts, shrink runs, and each failure with its shrunk ops."""
        return {
            "examples": self.examples,
            "ops": dict(self.op_counts),
            "pairs": {" > ".join(k): v for k, v in self.pair_counts.items()},
            "shrink_runs": self.shrink_runs,
            "failures": [(f.key, f.ops) for f in self.failures],
        }

    def to_json(self) -> dict:
        data = asdict(self)
        data["pair_counts"] = {" > ".join(k): v for k, v in self.pair_counts.items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> CampaignResult:
        data = dict(data)
        data["pair_counts"] = {tuple(k.split(" > ")): v for k, v in data["pair_counts"].items()}
        for name in ("failures", "listed_seen"):
            data[name] = [Failure.from_json(f) for f in data[name]]
        return cls(**data)


def conforms(result: CampaignResult) -> bool:
    """No failure of the contract (or of the harness); policy differences allowed."""
    return all(f.level == "policy" for f in result.failures)


class _Counter:
    """Splits test runs into generated examples and shrink runs (Hypothesis observability).

    Op counts of an example are added only when Hypothesis says it generated
    it (not while shrinking). An example Hypothesis gave up on (no enabled
    rule could be drawn; in a survey, it ended at a known failure) is not
    counted as one, as Hypothesis does not count it toward ``max_examples``,
    so that a budget of N examples reports N; its ops ran and are counted.
    Without observability every run counts as an example. Runs of
    Hypothesis's reuse phase (saved examples replayed from the database)
    count as ``replayed``; ``on_failed_replay`` is called after each that
    failed.
    """

    def __init__(self, result: CampaignResult, on_example):
        self.result, self.on_example = result, on_example
        self.on_failed_replay: Callable[[], None] | None = None
        self.pending: tuple[dict, dict, int] | None = None
        self.observed = False

    def example_done(self, ops: dict, pairs: dict, admitted: int = 0):
        self.pending = (ops, pairs, admitted)
        if not self.observed:
            self._count(generated=True)

    def observe(self, case):
        if getattr(case, "type", None) != "test_case":
            return
        self.observed = True
        how = str(getattr(case, "how_generated", ""))
        if "reuse" in how:  # "during reuse phase": a saved example, replayed
            if getattr(case, "status", None) == "failed" and self.on_failed_replay:
                self.on_failed_replay()
            self._count(generated=False, replayed=True)
            return
        valid = getattr(case, "status", None) != "gave_up"
        self._count(generated="generate" in how or "explicit" in how, example=valid)

    def _count(self, generated: bool, replayed: bool = False, example: bool = True):
        if self.pending is None:
            return
        ops, pairs, admitted = self.pending
        self.pending = None
        if replayed:
            self.result.replayed += 1
        elif generated:
            self.result.examples += example
            self.result.rounding_admitted += admitted
            for name, n in ops.items():
                self.result.op_counts[name] = self.result.op_counts.get(name, 0) + n
            for pair, n in pairs.items():
                self.result.pair_counts[pair] = self.result.pair_counts.get(pair, 0) + n
        else:
            self.result.shrink_runs += 1
        if self.on_example:
            self.on_example(self.result)


def run_campaign(
    impl: type,
    *,
    examples: int | None = None,
    minutes: float | None = None,
    profile: str = "nightly",
    seed: int = 0,
    survey: bool = False,
    contract_checks: bool = True,
    on_example: Callable[[CampaignResult], None] | None = None,
    shrink_runs: int | None = SHRINK_RUNS,
    database: ExampleDatabase | str | None = None,
    replay_only: bool = False,
    listed: Iterable[str] = (),
    quiet_rounds: int | None = None,
    on_round: Callable[[CampaignResult], None] | None = None,
) -> CampaignResult:
    """Run the machine against ``impl`` until ``examples`` or ``minutes`` is spent.

    A plain campaign stops at its first failure; a survey (``survey=True``)
    keeps every distinct failing check, each shrunk, and stops early only
    when every example ends in a failure it already has (``exhausted``).
    ``shrink_runs`` bounds each Hypothesis shrink (None: Hypothesis's own
    bound, in seconds). A survey that has found a contract failure stops
    once ``quiet_rounds`` generating rounds in a row find no new one (None:
    never early). ``on_round`` gets the result after each generating round.
    ``listed``: identities known to fail (a known-failures list), tolerated
    from the start and noted in ``listed_seen``.

    ``database`` (an example database or a spec for ``open_database``):
    failures are saved there, and a first round replays every example saved
    under this campaign's key, and only those: every saved failure that
    still fails is reported, and a plain campaign stops there. ``replay_only`` replays
    every saved example, shrinks what still fails and generates nothing (no
    budget needed); ``replayed == 0`` then means nothing was checked.
    """
    if replay_only and database is None:
        raise ValueError("replay_only needs a database to replay")
    if examples is None and minutes is None and not replay_only:
        raise ValueError("run_campaign needs an example budget or a time budget")
    if isinstance(database, str):
        from tqbatch.testing.search.databases import open_database

        database = open_database(database)
    register_profiles()
    base = settings.get_profile(profile)
    result = CampaignResult()
    known: dict[str, dict] = {}
    listed = frozenset(listed)
    observer = MachineObserver()  # every example's ops and failures, this campaign's only

    def tolerated(failure) -> bool:
        return failure.identity in listed or (survey and failure.identity in known)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsupportedOpsWarning)
        machine = machine_for(
            impl,
            contract_checks=contract_checks,
            tolerate=tolerated if survey or listed else None,
            observer=observer,
        )
    counter = _Counter(result, on_example)
    clock = RunClock()
    replayed_failures: set[str] = set()  # identities of saved examples that failed again

    class Counting(machine):
        def __init__(self):
            super().__init__()
            clock.tick()  # one test run: shrinking is bounded in these
            # This example's op counts: the observer's totals now, subtracted at teardown.
            self._before = observer.counts()

        def teardown(self):
            ops, pairs = observer.counts_since(self._before)
            worlds = self.worlds
            _note_listed(result, listed, worlds)
            counter.example_done(ops, pairs, sum(w.refs.admitted for w in worlds))

    key = campaign_key(impl, contract_checks=contract_checks, survey=survey)

    def failed_replay():
        failure = observer.last_failure  # recorded by the run that just failed
        if failure is not None:
            replayed_failures.add(failure.key)

    counter.on_failed_replay = failed_replay
    start = time.monotonic()
    deadline = start + minutes * 60 if minutes else None
    # With a database, the first round replays what is saved there and
    # generates nothing; generating rounds follow (none for replay_only).
    replaying = database is not None
    generating = 0  # generating rounds run: each has its own seed
    found_after: list[frozenset] = []  # contract failures known after each generating round

    def round_done(was_replaying: bool) -> None:
        if not was_replaying:
            result.seconds = time.monotonic() - start
            found_after.append(contract_identities(result))
            if on_round is not None:
                on_round(result)

    Counting.avoid_cases = frozenset(_diverging_cases(listed))
    # Codebooks solved once per process either way; fast_codebooks solves them sooner.
    with fast_codebooks(), hypothesis_internals.observing(counter.observe) as observed:
        # Where it observes, it reports every run, so none is counted before it says
        # what it was: with a database, a campaign's first run is a replay, not an example.
        counter.observed = observed
        while True:
            if not replaying:
                if replay_only:
                    break
                if survey and quiet_stop_round(found_after, quiet_rounds) is not None:
                    result.quiet_stop = True
                    break
                if examples is not None and result.examples >= examples:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    break
            left = ROUND_EXAMPLES if examples is None else examples - result.examples
            round_settings = settings(
                base,
                max_examples=ROUND_EXAMPLES if replaying else min(ROUND_EXAMPLES, left),
                # derandomize=True (the ci profile) would also make Hypothesis
                # ignore the database.
                derandomize=False,
                database=database,
                phases=[Phase.reuse if replaying else Phase.generate, Phase.shrink],
                # Replaying, every saved failure is replayed and reported: stopping
                # at the first that still fails would leave the others unreplayed,
                # so not saved again by this run, and a database rebuilt from what
                # runs save (a nightly's artifact) would lose them. Generating,
                # a round stops at its first failure and shrinks only that one,
                # so that it is reported at once; a survey's next round
                # tolerates it and goes on to the others.
                report_multiple_bugs=replaying,
                # A survey ends examples at known failures (a rejection).
                suppress_health_check=list(HealthCheck),
            )
            hypothesis_seed(seed * 1_000_003 + generating)(Counting)
            result.rounds += 1
            generating += not replaying
            was_replaying, replaying = replaying, False
            observer.clear_failures()
            try:
                with shrink_budget(shrink_runs, clock):
                    # Hypothesis's simplest example is the same in every round:
                    # the first generating round runs it, the others draw another.
                    hypothesis_internals.run_machine(
                        Counting, round_settings, key, simplest=generating <= 1
                    )
            except Unsatisfiable:
                result.exhausted = True  # every example hit a known, diverging failure
                round_done(was_replaying)
                break
            except unittest.SkipTest:
                if not was_replaying:
                    raise
                # Nothing saved under this campaign's key: the replay ran nothing.
            except Exception as exc:  # noqa: BLE001 - whatever the run raised is reported
                found = _found(observer, exc, sorted(set(known) | listed))
                # As Hypothesis shrank them: where the checks of "also" failed too.
                shrunk = [list(failure.ops) for failure in found]
                found = [_minimized(impl, failure, contract_checks) for failure in found]
                for failure in found:
                    failure.replayed = failure.key in replayed_failures
                    known[failure.key] = failure
                    result.failures.append(failure)
                for failure, ops in zip(found, shrunk) if survey else ():
                    for other in _also_found(impl, failure, ops, known, contract_checks):
                        known[other.key] = other
                        result.failures.append(other)
                Counting.avoid_cases = frozenset(_diverging_cases(set(known) | listed))
                crashed = any(not f.identity for f in found)
                if not survey or crashed or not found:
                    round_done(was_replaying)
                    break  # plain: the first failure; survey: the harness itself failed
            round_done(was_replaying)
    result.seconds = time.monotonic() - start
    return result


def contract_identities(result: CampaignResult) -> frozenset:
    """The identities of ``result``'s contract failures (policy differences left out)."""
    return frozenset(f.identity for f in result.failures if f.identity and f.level != "policy")


def quiet_stop_round(found_after: list, quiet_rounds: int | None) -> int | None:
    """The generating round after which a survey stops for quiet, or None: not yet.

    ``found_after[k]`` is the set of contract failures (identities) known
    after round ``k + 1``. The survey stops after round ``r`` where some
    failure was known ``quiet_rounds`` rounds before and no failing check
    was added since, or, at the latest, after twice the round of its first
    find plus ``quiet_rounds``: whichever comes first. A known check failing
    after another op (``mask_values@trim`` after ``mask_values@new``) is kept
    and reported but does not start the count again: it is most often the
    same defect reached through another op, and a cache with a wrong mask
    shows it after every op there is. The bound on the whole: a target that
    keeps showing new checks (one defect, many symptoms) is searched about
    as long again as its first find took, not to the end of its budget; the
    run is red from that first find on. A function of the rounds' finds
    alone, so the same rounds stop at the same place in one process or added
    up over several.
    """
    if not quiet_rounds:
        return None
    checks_after = [frozenset(_check_of(identity) for identity in found) for found in found_after]
    first = next((k + 1 for k, checks in enumerate(checks_after) if checks), None)
    for r in range(1, len(checks_after) + 1):
        if first is not None and r >= 2 * first + quiet_rounds:
            return r
        if r > quiet_rounds:
            before = checks_after[r - 1 - quiet_rounds]
            if before and before == checks_after[r - 1]:
                return r
    return None


def _check_of(identity: str) -> str:
    """The check an identity names: ``offset`` of ``offset@extend``."""
    return identity.split("@", 1)[0]


def campaign_key(impl: type, *, contract_checks: bool = True, survey: bool = False) -> bytes:
    """What a campaign's examples are saved under in an example database (its key, exactly).

    The target, and the switches that decide whether a saved example still
    fails: without the contract checks a structural failure does not fire,
    and a survey draws its later examples with known failures tolerated and
    their bad-input cases avoided, so the same choices make other ops. A
    campaign replaying another's examples would report nothing new and, the
    examples no longer failing, delete them from the shared database. The
    profile (steps per example) is left out: it only bounds how long an
    example may be.
    """
    return json.dumps(
        {
            "campaign": "tqbatch.testing.search.campaign",
            "target": impl_spec(impl),
            "contract_checks": bool(contract_checks),
            "survey": bool(survey),
        },
        sort_keys=True,
    ).encode()


def _diverging_cases(identities) -> set[str]:
    """Bad-input cases whose known failure diverges the target (accepted, or changed the
    cache): drawing them again would only throw the rest of the example away."""
    from tqbatch.testing.contract.ops import BAD_INPUT_ERRORS

    cases = set()
    for identity in identities:
        name, _, where = identity.partition("@")
        check = CHECKS.get(name)
        if check is not None and check.diverged and where in BAD_INPUT_ERRORS:
            cases.add(where)
    return cases


def _note_listed(result: CampaignResult, listed: frozenset, worlds) -> None:
    """Add the listed identities the example's ``worlds`` tolerated to ``listed_seen``."""
    seen = {f.identity for f in result.listed_seen}
    for world in worlds:
        for failure in world.tolerated:
            if failure.identity in listed and failure.identity not in seen:
                seen.add(failure.identity)
                result.listed_seen.append(
                    Failure(identity=failure.identity, level=failure.level, what=failure.what)
                )


def _minimized(impl, failure: Failure, contract_checks: bool) -> Failure:
    """``failure`` with its shrink finished op by op (``tqbatch.testing.search.minimize``)."""
    if not failure.identity or not failure.ops:
        return failure
    tolerated = set(failure.tolerated)
    ops, check_failure = minimize(
        impl,
        failure.config,
        failure.ops,
        failure.identity,
        (lambda f: f.identity in tolerated) if tolerated else None,
        contract_checks=contract_checks,
        replays=MINIMIZE_REPLAYS,
    )
    if check_failure is None:
        return failure
    return replace(failure, ops=ops, message=str(check_failure), what=check_failure.what)


def _also_found(
    impl, failure: Failure, ops: list, known: dict, contract_checks: bool
) -> list[Failure]:
    """The failures of ``failure.also`` not yet ``known``, each as its own record.

    Each is what a survey reports for it: ``ops`` (the found failure's, as
    Hypothesis shrank them), replayed with the failures before it at that op
    tolerated (so that it is the one raised), cut down op by op
    (``tqbatch.testing.search.minimize``). One that does not replay so is left to
    the search.
    """
    tolerated = set(failure.tolerated) | {failure.identity}
    out = []
    for identity in failure.also:
        if identity in known:
            tolerated.add(identity)
            continue
        seen = frozenset(tolerated)
        cut, check_failure = minimize(
            impl,
            failure.config,
            ops,
            identity,
            lambda f, seen=seen: f.identity in seen,
            contract_checks=contract_checks,
            replays=MINIMIZE_REPLAYS,
        )
        tolerated.add(identity)
        if check_failure is None:
            continue
        out.append(
            replace(
                Failure.of(check_failure, impl=failure.impl, config=failure.config, ops=cut),
                final=failure.final,
                replayed=failure.replayed,
                tolerated=sorted(seen),
            )
        )
    return out


def _found(observer: MachineObserver, exc: BaseException, tolerated: list[str]) -> list[Failure]:
    """The failures a round raised, as ``observer`` recorded them: each its final (shrunk) one."""
    recorded = list(observer.failures.values())
    final = [f for f in recorded if f.final] or recorded
    if not final:
        # Nothing recorded: the machine itself broke (e.g. a strategy error).
        return [Failure.of(exc, ops=[], tolerated=tolerated)]
    return [replace(failure, tolerated=tolerated) for failure in final]


def save_failures(result: CampaignResult, directory, *, backend=None, options=None) -> list:
    """Write each failure as a scenario (``scenario.write_failure``); its path, or None where
    there is nothing to replay (the harness itself failed)."""
    from tqbatch.testing.replay.scenario import write_failure

    paths = []
    for failure in result.failures:
        if not failure.ops:
            paths.append(None)
            continue
        paths.append(
            write_failure(
                failure.ops,
                failure.config,
                directory,
                error=failure.message,
                backend=backend,
                options=options,
                identity=failure.identity or None,
                tolerated=failure.tolerated,
            )
        )
    return paths


def survey_test_case(impl: type | None = None, *, examples: int = 60, seed: int = 0):
    """A ``unittest.TestCase`` that surveys ``impl`` and fails listing every distinct failure.

    The pytest entry of ``tqbatch fuzz --survey``: one test whose failure
    message is the whole list (identity, level, shrunk op count, what
    failed), contract and policy alike. Uses the ``ci`` profile's steps.
    """
    import unittest

    from tqbatch.testing.target import load_impl

    target = impl if impl is not None else load_impl()

    class SurveyTest(unittest.TestCase):
        def runTest(self):
            result = run_campaign(target, examples=examples, profile="ci", seed=seed, survey=True)
            lines = [
                f"{f.identity or '(harness)'} [{f.level}] {len(f.ops or ())} ops: {f.summary}"
                for f in result.failures
            ]
            if lines:
                self.fail(f"{len(lines)} distinct failures:\n" + "\n".join(lines))

    SurveyTest.__name__ = f"Survey_{target.__name__}"
    return SurveyTest
