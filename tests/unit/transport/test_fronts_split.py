"""`--fronts N`: a step's output split per owning front; the sweep can vary the fronts."""

from __future__ import annotations

from cadence.config import ServerConfig
from cadence.lab.sweep import _server_args, parse_vary
from cadence.lifecycle.front_layout import FrontLayout
from cadence.router.admission import SharedAdmissionGate
from cadence.transport.messages import StepOutput, step_pieces
from cadence.transport.worker_to_fronts import split_step


def test_split_step_gives_each_front_its_sequences_only() -> None:
    step = StepOutput(3, 7, 10, 20, [1, 2, 3, 4], [11, 12, 13, 14], [4], [1], prompt_lens={2: 5})
    zero, one = split_step(step, 2)
    assert (zero.seq_ids, zero.token_ids, zero.finished_ids, zero.finish_reasons) == (
        [2, 4],
        [12, 14],
        [4],
        [1],
    )
    assert zero.prompt_lens == {2: 5} and one.prompt_lens == {}
    assert (one.seq_ids, one.token_ids, one.finished_ids) == ([1, 3], [11, 13], [])
    assert (one.worker, one.step, one.start_ns, one.end_ns) == (3, 7, 10, 20)


def test_split_step_keeps_pieces_and_texts_and_skips_idle_fronts() -> None:
    pieces = StepOutput(0, 1, 0, 1, [3, 6], [1, 2, 3, 4, 5], [], [], token_counts=[2, 3])
    zero, one, two = split_step(pieces, 3)
    assert (zero.seq_ids, zero.token_ids, zero.token_counts) == ([3, 6], [1, 2, 3, 4, 5], [2, 3])
    assert one is None and two is None
    texts = StepOutput(0, 1, 0, 1, [1, 2], [65, 66], [], [], texts=["A", "B"])
    zero, one = split_step(texts, 2)
    assert (zero.texts, one.texts) == (["B"], ["A"])
    both = StepOutput(
        0, 1, 0, 1, [1, 2], [65, 66, 67], [], [], token_counts=[1, 2], texts=["A", "BC"]
    )
    zero, one = split_step(both, 2)
    assert (zero.token_ids, zero.token_counts, zero.texts) == ([66, 67], [2], ["BC"])
    assert (one.token_ids, one.token_counts, one.texts) == ([65], [1], ["A"])


def test_split_step_keeps_what_each_piece_counts_for_and_the_hand_offs_done() -> None:
    """A batched model's text pieces are one output each, however many tokens: each front's
    part says so too (else its front counts every token as an output); a decode worker's
    imported sequences go to their owners."""
    pieces = StepOutput(
        0,
        1,
        0,
        1,
        [1, 2],
        [65, 66, 67],
        [],
        [],
        token_counts=[1, 2],
        texts=["A", "BC"],
        piece_outputs=True,
        imported=[2, 5],
        cpu_wait_ns=7,
    )
    zero, one = split_step(pieces, 2)
    assert zero.piece_outputs and one.piece_outputs
    assert (zero.imported, one.imported) == ([2], [5])
    assert zero.cpu_wait_ns == one.cpu_wait_ns == 7
    only_imports = StepOutput(0, 1, 0, 1, [], [], [], [], imported=[3])
    assert split_step(only_imports, 2) == [
        None,
        StepOutput(0, 1, 0, 1, [], [], [], [], imported=[3]),
    ]


def test_step_pieces_reads_every_layout() -> None:
    one = StepOutput(0, 1, 0, 1, [4, 5], [65, 66], [], [])
    assert list(step_pieces(one)) == [(4, 65, None), (5, 66, None)]  # a bare token each
    several = StepOutput(
        0, 1, 0, 1, [4, 5], [1, 2, 3], [], [], token_counts=[2, 1], texts=["x", ""]
    )
    assert list(step_pieces(several)) == [(4, [1, 2], "x"), (5, [3], "")]


def test_shared_gate_limits_all_fronts_together(tmp_path) -> None:
    path = str(tmp_path / "admission")
    a, b = SharedAdmissionGate(path, 0, 2, 3), SharedAdmissionGate(path, 1, 2, 3)
    assert a.try_enter() and b.try_enter() and b.try_enter()
    assert not a.try_enter() and not b.try_enter()
    b.leave()
    assert a.try_enter()
    a.clear(1)  # front 1 died: its slot is free
    assert sum(a._counts) == 2 and a.try_enter()  # streams open on all fronts


def test_sweep_varies_fronts() -> None:
    assert parse_vary("fronts=1,2") == ("fronts", ["1", "2"])
    assert _server_args(["--step-ms", "5"], "fronts", "2") == ["--step-ms", "5", "--fronts", "2"]


def test_one_front_gives_its_workers_no_other_fronts_sockets() -> None:
    # One front makes no shared folder (base stays None): its workers connect to it alone.
    assert FrontLayout(ServerConfig()).other_fronts_sockets(2) == ([[], []], [])
    two = FrontLayout(ServerConfig(fronts=2), base="/b").other_fronts_sockets(2)
    assert two == ([["ipc:///b/f1-in-0"], ["ipc:///b/f1-in-1"]], ["ipc:///b/f1-out"])
