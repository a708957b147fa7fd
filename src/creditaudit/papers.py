"""The registry of the rules' own paper settings: what `creditaudit reproduce RULE` trains.

Each rule declares its setting beside its recipe (`Method.paper_setting`, methods/setting.py): the
paper's data, a plain MLP of the paper's size, its output loss, its recipe and epochs, and the test
error the paper reports for the rule and for backprop there, each with the place it comes from.
`reproduce` trains the rule and bp in it, audits the runs as any audit does, and puts the paper's
numbers beside ours (report/reproduction.py). A rule without a declared setting has none here.
"""
from __future__ import annotations

import dataclasses

from .errors import CreditAuditError
from .methods import METHODS
from .methods.setting import DEFAULT_SPREAD, PaperSetting, Reported

# rule → its paper setting, in the registry's order; `rule` filled in from the rule's name. Only a
# setting a class declares itself counts: a subclass that is another rule (dfa-penalty of dfa,
# sign-symmetry of fa) was not run in its parent's paper
PAPERS: dict[str, PaperSetting] = {
    name: dataclasses.replace(cls.__dict__["paper_setting"], rule=name)
    for name, cls in METHODS.items() if cls.__dict__.get("paper_setting") is not None}

Paper = PaperSetting          # the name the report and tests use


def paper(rule: str) -> PaperSetting:
    """The paper setting of `rule`, or one line naming those there are."""
    if rule not in PAPERS:
        raise CreditAuditError(f"no paper setting for {rule!r}; `creditaudit reproduce` knows "
                               f"{', '.join(PAPERS)} (`creditaudit reproduce --list` shows them)")
    return PAPERS[rule]


__all__ = ["DEFAULT_SPREAD", "PAPERS", "Paper", "PaperSetting", "Reported", "paper"]
