"""What ``conformance`` and ``fuzz --known-failures`` share: a survey judged as a CI gate.

A survey's failures (``tqbatch.testing.search.campaign``) are judged against the
target's known failures (``tqbatch.testing.gate.known_failures``): a contract
failure that is not listed fails the run, a listed one is reported as
expected, a listed one not found is reported as no longer failing (and fails
the run only with ``--strict-known-failures``). Policy differences never
fail a run: they are listed, and may be listed as known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tqbatch.testing.contract.failure import Failure
from tqbatch.testing.gate.known_failures import (
    KnownFailures,
    KnownFailuresError,
    Triage,
    format_known_failures,
    shipped,
)


def add_known_failures_arguments(parser, *, per_target: bool) -> None:
    """``--known-failures`` and ``--strict-known-failures``."""
    if per_target:
        help_text = (
            "known failures (a file, or the name of a list tqbatch ships, e.g. mlx_vlm_0_7_10): "
            "FILE applies to every target, TARGET=FILE to that target only; repeatable, the "
            "lists that apply to a target are merged. A contract failure that is not listed "
            "fails the run"
        )
    else:
        help_text = (
            "known failures (a file, or the name of a list tqbatch ships, e.g. mlx_vlm_0_7_10): "
            "the run fails only for contract failures not listed there (implies --survey)"
        )
    parser.add_argument(
        "--known-failures",
        action="append",
        default=[],
        metavar="[TARGET=]FILE" if per_target else "FILE",
        help=help_text,
    )
    parser.add_argument(
        "--strict-known-failures",
        action="store_true",
        help="also fail when a listed failure was not found (fixed, or out of this budget's "
        "reach): keeps the list true",
    )


def known_failures_path(name: str) -> Path:
    """A known-failures file by path, else by the name of a shipped list."""
    path = Path(name)
    if path.is_file():
        return path
    found = shipped(name)
    if found is not None:
        return found
    raise KnownFailuresError(
        f"{name}: no such known-failures file (nor a list tqbatch ships: "
        "see tqbatch/known_failures/)"
    )


def load_known_failures(names) -> KnownFailures:
    """The merged lists of ``names`` (paths or shipped names); empty for none."""
    known = KnownFailures.empty()
    for name in names:
        known = known.merged(KnownFailures.load(known_failures_path(name)))
    return known


@dataclass
class Verdict:
    """One target's survey, judged (see the module docstring)."""

    name: str  # as the command line named it
    impl: str  # module:Class
    examples: int
    contract: list[Failure] = field(default_factory=list)  # contract and harness failures
    policy: list[Failure] = field(default_factory=list)
    paths: dict = field(default_factory=dict)  # failure key -> saved scenario
    triage: Triage = field(default_factory=Triage)
    failing: list = field(default_factory=list)  # identities that fail the run
    known_failures: list = field(default_factory=list)  # the files applied
    unsupported_ops: list = field(default_factory=list)
    unsupported_configurations: list = field(default_factory=list)

    @property
    def conforms(self) -> bool:
        return not self.contract

    def passes(self, strict: bool = False) -> bool:
        return not self.failing and not (strict and self.triage.fixed)

    def to_json(self, strict: bool = False) -> dict:
        return {
            "target": self.name,
            "impl": self.impl,
            "examples": self.examples,
            "conforms": self.conforms,
            "passes": self.passes(strict),
            "contract_failures": [self._failure(f) for f in self.contract],
            "policy_differences": [self._failure(f) for f in self.policy],
            "known_failures_files": list(self.known_failures),
            # new: what fails the run (a policy difference not listed is only listed above)
            "known": list(self.triage.known),
            "new": list(self.failing),
            "fixed": list(self.triage.fixed),
            "unsupported": {
                "ops": list(self.unsupported_ops),
                "configurations": list(self.unsupported_configurations),
            },
        }

    def _failure(self, failure: Failure) -> dict:
        path = self.paths.get(failure.key)
        return {
            "identity": failure.identity or None,
            "check": failure.check or None,
            "level": failure.level,
            "what": failure.summary,
            "message": failure.message,
            "scenario": str(path) if path else None,
            "ops": failure.ops or [],
            "config": failure.config,
        }

    def report_lines(self, strict: bool = False) -> list[str]:
        """What a log shows of the triage, beyond the failures themselves."""
        lines = []
        j = self.triage
        if self.known_failures:  # else every contract failure fails the run: nothing to add
            lines.append(
                f"  known failures ({', '.join(self.known_failures)}): {len(j.known)} found "
                "as listed"
            )
            lines += [f"  NEW: {i} is not a known failure" for i in self.failing]
        for identity in j.fixed:
            what = "fails the run (--strict-known-failures)" if strict else "update the list"
            lines.append(
                f"  NO LONGER FAILS: {identity} is listed as a known failure but was not found "
                f"(fixed, or not reached in {self.examples} examples): {what}"
            )
        if self.unsupported_configurations:
            lines.append(
                "  unsupported configurations (not drawn): "
                + ", ".join(self.unsupported_configurations)
            )
        return lines


def verdict_of(name, impl, result, known: KnownFailures, files=(), paths=()) -> Verdict:
    """``result`` (a survey of ``impl``) against ``known``."""
    from tqbatch.testing.target import impl_spec, missing_capabilities, unsupported_configurations

    spec = impl_spec(impl)
    contract = [f for f in result.failures if f.level != "policy"]
    policy = [f for f in result.failures if f.level == "policy"]
    triage = known.triage(f.key for f in result.failures)
    gated = {f.key for f in contract}
    return Verdict(
        name=name,
        impl=spec,
        examples=result.examples,
        contract=contract,
        policy=policy,
        paths={f.key: p for f, p in zip(result.failures, paths) if p},
        triage=triage,
        failing=[i for i in triage.new if i in gated],
        known_failures=[str(f) for f in files],
        unsupported_ops=missing_capabilities(impl),
        unsupported_configurations=unsupported_configurations(impl),
    )


def write_known_failures(path, verdict: Verdict, command: str) -> int:
    """Write every contract failure of ``verdict`` as a known failure; their number.

    Each reason is what the check saw, prefixed so that a human replaces it
    with why the failure is known (an upstream issue, a decision).
    """
    from tqbatch.testing.target import load_impl

    header = [
        f"Known failures of {verdict.impl}{_version_of(load_impl(verdict.impl))}.",
        f"Generated by: {command}",
        f"({verdict.examples} examples; policy differences are not listed: they never fail a run.)",
        "Each reason is what the check saw, marked 'unreviewed:': replace it with why the",
        "failure is known (an upstream issue, a decision). Format: IDENTITY  # REASON.",
    ]
    pairs = [
        (f.key, "unreviewed: " + (f.summary or "-"))
        for f in verdict.contract
        if f.identity  # a harness failure has no identity to list
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_known_failures(pairs, header), encoding="utf-8")
    return len(pairs)


def _version_of(cls: type) -> str:
    """`` (DIST VERSION)`` of the distribution that installs ``cls``'s package, or ``""``."""
    from importlib import metadata

    top = cls.__module__.partition(".")[0]
    try:
        dists = metadata.packages_distributions().get(top) or []
        return f" ({dists[0]} {metadata.version(dists[0])})" if dists else ""
    except Exception:  # noqa: BLE001 - a version is a courtesy of the header
        return ""


def dumps(data) -> str:
    return json.dumps(data, indent=2, sort_keys=False)
