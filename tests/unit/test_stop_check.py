"""STOP and LENGTH are decided in one function (cadence.worker.stop_check), for the batch
scheduler's outputs and the app runner's pieces alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cadence
from cadence.vocabulary import Finish
from cadence.worker.stop_check import check_stop, stop_in_piece

STOPS = frozenset({7, 9})


@pytest.mark.parametrize(
    ("token", "generated", "finish"),
    [
        (1, 1, Finish.NONE),
        (7, 1, Finish.STOP),  # a stop token ends it, and is sent
        (1, 4, Finish.LENGTH),  # the max_tokens-th output
        (9, 4, Finish.STOP),  # a stop token at the last allowed output: STOP
        (None, 3, Finish.NONE),  # a text piece: no stop token matches it...
        (None, 4, Finish.LENGTH),  # ...but it counts toward max_tokens
    ],
)
def test_check_stop(token: int | None, generated: int, finish: Finish) -> None:
    assert check_stop(token, generated, 4, STOPS) is finish


@pytest.mark.parametrize(
    ("tokens", "generated", "stops", "expected"),
    [
        ([1, 2], 0, STOPS, (2, Finish.NONE)),
        ([1, 7, 2, 9], 0, STOPS, (2, Finish.STOP)),  # cut after the first stop token
        ([1, 2, 3, 4, 5], 2, STOPS, (3, Finish.LENGTH)),  # cut at max_tokens (5)
        ([1, 2, 9, 4], 2, STOPS, (3, Finish.STOP)),  # stop at the last allowed: STOP
        ([1, 2, 3, 9], 2, STOPS, (3, Finish.LENGTH)),  # a stop past max_tokens is not sent
        ([1, 2, 3, 4, 5], 2, frozenset(), (3, Finish.LENGTH)),
        ([1, 2], 2, frozenset(), (2, Finish.NONE)),
        ([1, 2, 3], 2, frozenset(), (3, Finish.LENGTH)),
    ],
)
def test_stop_in_piece(
    tokens: list[int], generated: int, stops: frozenset, expected: tuple[int, Finish]
) -> None:
    assert stop_in_piece(tokens, generated, 5, stops) == expected


def test_stop_in_piece_is_check_stop_token_by_token() -> None:
    """A piece ends where the first of its tokens, given one at a time, would have ended it."""
    for generated in range(6):
        for tokens in ([1, 2, 3, 4, 5, 6], [7, 1], [1, 1, 9, 7], [2, 2, 2, 2, 2, 2, 9]):
            one_by_one = (len(tokens), Finish.NONE)
            for i, token in enumerate(tokens):
                finish = check_stop(token, generated + i + 1, 6, STOPS)
                if finish:
                    one_by_one = (i + 1, finish)
                    break
            assert stop_in_piece(tokens, generated, 6, STOPS) == one_by_one
            assert min(len(tokens), 6 - generated) >= one_by_one[0]


def test_no_other_worker_or_engine_module_decides_stop_or_length() -> None:
    """The worker's and the engines' code names LENGTH, and tests a stop token or max_tokens,
    only in stop_check.py (a model's own end, STOP, is reported where it happens)."""
    root = Path(cadence.__file__).parent
    found = []
    for module in sorted([*root.glob("worker/**/*.py"), *root.glob("engines/**/*.py")]):
        if module.name == "stop_check.py":
            continue
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "LENGTH":
                found.append(f"{module.name}:{node.lineno} Finish.LENGTH")
            if isinstance(node, ast.Compare):
                names = {
                    n.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Attribute) and n.attr in ("stop_token_ids", "max_tokens")
                }
                membership = any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
                bound = any(isinstance(op, ast.GtE | ast.Gt) for op in node.ops)
                if ("stop_token_ids" in names and membership) or ("max_tokens" in names and bound):
                    found.append(f"{module.name}:{node.lineno} {ast.unparse(node)}")
    assert found == []
