"""The diagnosis package's docstring lists every rule, under the module that holds it."""

from __future__ import annotations

import re

from cadence.lab.analysis import diagnosis


def test_the_package_docstring_lists_every_rule_under_its_module() -> None:
    listed = {}
    for line in re.split(r"\n- ", diagnosis.__doc__)[1:]:
        family, _, names = line.partition(":")
        listed[family.strip("` ")] = set(
            re.findall(r"\b[a-z]+(?:_[a-z]+)+\b|\b[a-z]+\b", names.split("(")[0])
        )
    for rule in diagnosis.RULES:
        family = rule.check.__module__.rsplit(".", 1)[-1]
        assert rule.name in listed.get(family, ()), (rule.name, family)
