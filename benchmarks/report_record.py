"""A claim as data, and the one function that turns a claim and a stored line into a row.

A :class:`Claim` names its benchmark, the fields it reads from a line (``ours``, ``peer``, the
line's own ``ratio``, its ``goal``, repeated ``*_runs``, the numbers it ``needs``), the peer
(``peer_name``) and its words, as templates over the line. :func:`figure` applies the same
rules to every claim (``report_rules``): the ratio in words, no claim of speed from a busy
line, "within noise" where the runs overlap or the ratio is within 10% of 1, the goal the line
records. A claim whose line needs more than a lookup names a helper (``values``: derived figures
the templates read; ``figure``: the whole row, for the few claims whose row has branches).

Templates: ``{path}`` is the line's value at ``path`` (keys joined by ``/``: ``plane/mnist/mb``;
``?`` where the line has none); ``{path:spec}`` formats it (``num`` 12,661, ``x`` 0.84x, ``pc``
98.73%, ``pcg`` 99%, ``list`` a list's items joined by commas, or any Python format spec such as ``+.2f``); ``[[...]]`` is left out when a
field inside it is missing. A template may also read what :func:`figure` computed: ``ours``,
``peer``, ``ratio``, ``unit``, ``peer_name``, and ``versus`` (``34.7 s vs 41.2 s (0.84x)``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import report_rules as rules

# a value a line stands for when it does not record it: the benchmarks' default target
DEFAULTS: dict[str, object] = {"target": 0.99}
SPECS: dict[str, Callable[[float], str]] = {
    "num": rules.num,
    "x": rules.ratio,
    "pc": rules.pc,
    "pcg": lambda v: f"{100 * v:g}%",
    "list": str,  # a list's items, joined by ", " (see _format)
}
SPEEDS = ("noise", "load", "none")
# what figure() computes, for the templates (not read from the line)
COMPUTED = ("ours", "peer", "ratio", "unit", "peer_name", "versus")
# the fields of a Claim that are templates
TEMPLATES = (
    "what",
    "peer_label",
    "ours_note",
    "peer_note",
    "ours_cell",
    "peer_cell",
    "words",
    "lead",
    "more",
    "calm",
    "brief",
    "alone_peer",
    "alone_words",
)
_FIELD = re.compile(r"\{([A-Za-z0-9_./]+)(?::([^{}]*))?\}")
_GROUP = re.compile(r"\[\[(.*?)\]\]", re.S)


class ClaimError(ValueError):
    """A claim record that can not be read: the message is one line naming the claim."""


@dataclass(frozen=True)
class Figure:
    """What one stored line says about one claim."""

    what: str  # the claim, for a person (may name the line's settings)
    ours: str  # our figure
    peer: str  # the peer, named, and its figure
    words: str  # how the two compare, for a person ("0.84x the time PyTorch takes")
    brief: str  # the same, short, for the list of every run
    timed: bool = True  # a wall-clock figure: a busy machine's line makes no claim of it


Values = Callable[[dict], Mapping[str, Any] | None]


@dataclass(frozen=True, kw_only=True)
class Claim:
    """One row of the headline table, as data (see the module's doc for the templates)."""

    bench: str  # benchmarks/results/BENCH.jsonl
    name: str  # short, for the column of the list of every run
    what: str  # the claim, for a person (template)
    # the fields read: our figure, the peer's, the line's own ratio (computed before rounding;
    # else ours / peer), the goal (a key of the line's "goals", or a fixed number)
    ours: str = ""
    peer: str = ""
    ratio: str = ""
    goal: str | float = ""
    ours_runs: str = ""  # repeated runs of each side: overlapping runs are within noise
    peer_runs: str = ""
    needs: tuple[str, ...] = ()  # what the line must hold to measure this (default: ours)
    when: tuple[str, object] | None = None  # (path, value): only lines where path == value
    # the peer and the words
    unit: str = ""
    peer_name: str = ""  # in the words: "0.84x the time PyTorch takes"
    peer_label: str = ""  # in the peer's cell (default peer_name)
    less_is_better: bool = False  # a time (the words say "the time ... takes") or a rate
    ours_note: str = ""  # after our figure: " (3 epochs)"
    peer_note: str = ""
    ours_cell: str = ""  # the cells, when not "{ours:num} {unit}{ours_note}" and the peer's
    peer_cell: str = ""
    words: str = ""  # the comparison (default from less_is_better), vetted by `speed`
    lead: str = ""  # words before the comparison
    more: str = ""  # words after it (and after the goal)
    calm: str = ""  # words after those, only from a line that may claim speed
    brief: str = "{versus}"  # for the list of every run
    # the peer's cell and the words with no peer (default: peer_cell, else "NAME: not run")
    alone_peer: str = ""
    alone_words: str = "no peer in this run"
    # how the words are vetted: "noise" (busy, then within noise), "load" (busy only), "none"
    # (not a wall-clock figure: the row claims no speed)
    speed: str = "noise"
    # the newest line that measures it (a file whose lines measure different parts), not only
    # the file's newest line
    any_line: bool = False
    values: Values | None = None  # derived figures the templates read; None: not measured
    figure: Callable[[Claim, dict], Figure | None] | None = None  # the whole row, when branched

    def __post_init__(self) -> None:
        def fail(why: str) -> None:
            raise ClaimError(f"claim {self.bench or '?'}/{self.name or '?'}: {why}")

        for key in ("bench", "name", "what"):
            if not getattr(self, key):
                fail(f"no {key}")
        if self.speed not in SPEEDS:
            fail(f"speed {self.speed!r} is not one of {', '.join(SPEEDS)}")
        if self.figure is None and not (self.ours or self.needs or self.values):
            fail("reads nothing (no ours, needs, values or figure)")
        if self.versus and not self.figure and not (self.unit or self.ours_cell):
            fail("no unit (a claim with a peer or a ratio shows its figures in a unit)")
        if self.peer and not self.peer_name:
            fail(f"no peer_name (the peer {self.peer!r} is named in its words)")
        for key in TEMPLATES:
            why = template_error(getattr(self, key))
            if why:
                fail(f"{key}: {why}")

    @property
    def versus(self) -> bool:
        """A comparison with a peer (or the line's own ratio)."""
        return bool(self.peer or self.ratio)

    def needed(self) -> tuple[str, ...]:
        return self.needs or ((self.ours,) if self.ours else ())

    def newest(self, lines: list[dict]) -> dict | None:
        """The line the headline shows for this claim."""
        for ln in reversed(lines if self.any_line else lines[-1:]):
            if figure(self, ln) is not None:
                return ln
        return None


# --- templates ---


class _Missing(Exception):
    pass


def template_error(text: str) -> str:
    """Why ``text`` is not a template (a stray brace, an unknown format), or ""."""
    for m in _FIELD.finditer(text):
        spec = m.group(2) or ""
        if spec and spec not in SPECS:
            try:
                format(1.5, spec)
            except ValueError:
                return f"unknown format {spec!r} in {m.group(0)}"
    bare = _GROUP.sub(lambda m: m.group(1), _FIELD.sub("", text))
    for mark in ("{", "}", "[[", "]]"):
        if mark in bare:
            return f"a stray {mark!r} in {text!r}"
    return ""


def present(v: object) -> bool:
    """A number (0 too), or a value that is not empty (a list, a string, True)."""
    return rules.is_num(v) or bool(v)


def lookup(sources: list[Mapping[str, Any]], path: str) -> Any:
    """The first value at ``path`` in ``sources`` (None in none)."""
    for source in sources:
        v = rules.get(source, path)
        if v is not None:
            return v
    return None


def _format(v: Any, spec: str) -> str:
    if not spec:
        return str(v)
    if spec == "list" and isinstance(v, list):
        return ", ".join(str(x) for x in v)
    if not rules.is_num(v):
        raise _Missing
    return SPECS[spec](v) if spec in SPECS else format(v, spec)


def fill(template: str, sources: list[Mapping[str, Any]]) -> str:
    """``template`` with the fields of ``sources`` (see the module's doc)."""
    out = []
    for i, part in enumerate(_GROUP.split(template)):
        optional = i % 2 == 1

        def one(m: re.Match, optional: bool = optional) -> str:
            try:
                v = lookup(sources, m.group(1))
                if v is None:
                    raise _Missing
                return _format(v, m.group(2) or "")
            except _Missing:
                if optional:
                    raise
                return "?"

        try:
            out.append(_FIELD.sub(one, part))
        except _Missing:
            continue
    return "".join(out)


# --- a claim on a line ---


def _goal(claim: Claim, line: dict) -> str:
    goal = claim.goal if rules.is_num(claim.goal) else rules.get(line, f"goals/{claim.goal}")
    if not claim.goal or not rules.is_num(goal):
        return ""
    return (
        f" (goal: {'at most' if claim.less_is_better else 'at least'} {rules.ratio(float(goal))})"
    )


def figure(claim: Claim, line: dict) -> Figure | None:
    """What ``line`` says about ``claim``: None when it does not measure it."""
    if claim.figure is not None:
        return claim.figure(claim, line)
    return versus(claim, line)


def versus(claim: Claim, line: dict) -> Figure | None:
    """The row of a claim from its record: ours beside the peer, their ratio in words as the
    line may claim it (``report_rules``)."""
    if claim.when and rules.get(line, claim.when[0]) != claim.when[1]:
        return None
    derived = claim.values(line) if claim.values else {}
    if derived is None:
        return None
    src: list[Mapping[str, Any]] = [derived, line, DEFAULTS]

    def val(path: str) -> Any:
        return lookup(src, path) if path else None

    if not all(present(val(p)) for p in claim.needed()):
        return None
    ours, peer, r = val(claim.ours), val(claim.peer), val(claim.ratio)
    if claim.ours and not rules.is_num(ours):
        return None
    no_peer = bool(claim.peer) and (not rules.is_num(peer) or not peer)
    if not rules.is_num(r):
        r = ours / peer if rules.is_num(ours) and not no_peer and claim.peer else None
    alone = claim.versus and (no_peer or r is None)
    unit = claim.unit
    versus_text = None
    if rules.is_num(ours):
        versus_text = f"{rules.num(ours)} {unit}"
        if not alone and rules.is_num(peer) and r is not None:
            versus_text += f" vs {rules.num(peer)} {unit} ({rules.ratio(r)})"
    computed = {
        "ours": ours,
        "peer": peer,
        "ratio": r,
        "unit": unit,
        "peer_name": claim.peer_name,
        "versus": versus_text,
    }
    ns: list[Mapping[str, Any]] = [computed, *src]
    ours_cell = claim.ours_cell or "{ours:num} {unit}" + claim.ours_note
    if alone:
        peer_cell = claim.alone_peer or claim.peer_cell or "{peer_name}: not run"
        words = fill(claim.lead + claim.alone_words + claim.more, ns)
    else:
        peer_cell = claim.peer_cell or (
            (claim.peer_label or "{peer_name}") + ": {peer:num} {unit}" + claim.peer_note
        )
        words = fill(claim.lead, ns) + vetted(claim, line, ns, r)
        words += _goal(claim, line) + fill(claim.more, ns)
        if not rules.busy(line):
            words += fill(claim.calm, ns)
    return Figure(
        fill(claim.what, ns),
        fill(ours_cell, ns),
        fill(peer_cell, ns),
        words,
        fill(claim.brief, ns),
        timed=claim.speed != "none",
    )


def vetted(claim: Claim, line: dict, ns: list[Mapping[str, Any]], r: float | None) -> str:
    """The claim's comparison in words, as ``line`` may claim it (its ``speed`` rule)."""
    default = (
        "{ratio:x} the time {peer_name} takes"
        if claim.less_is_better
        else "{ratio:x} the {unit} of {peer_name}"
    )
    words = fill(claim.words or (default if claim.versus else ""), ns)
    if claim.speed == "none" or r is None:
        return words
    if claim.speed == "load":
        return rules.busy(line) or words
    runs = {
        "ours_runs": lookup(ns, claim.ours_runs) if claim.ours_runs else None,
        "peer_runs": lookup(ns, claim.peer_runs) if claim.peer_runs else None,
    }
    return rules.speed_words(line, words, r, unit=claim.unit, **runs)
