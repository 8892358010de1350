"""Tensor parallelism: two gloo ranks (two processes) give the tokens of one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")

from tests.llama_models import hf_greedy, run_rank, save_model

N = 10
REQUESTS = [
    {"prompt_token_ids": [0, 17, 42, 99, 5, 250, 31], "max_tokens": N, "join": 0},
    {"prompt_token_ids": [0, 8], "max_tokens": N, "join": 0},
    {"prompt_token_ids": list(range(3, 40)), "max_tokens": N - 4, "join": 2},
    {
        "prompt_token_ids": [0, 9, 9, 9],
        "max_tokens": N,
        "join": 3,
        "sampling": {"temperature": 0.8, "seed": 11},
    },
]


@pytest.mark.slow
def test_two_ranks_give_the_tokens_of_one(tmp_path):
    folder = str(
        save_model(
            tmp_path / "m",
            tokenizer=False,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
        )
    )
    init = f"file://{tmp_path}/store"
    args = [folder, "2", init, json.dumps(REQUESTS)]
    # Rank 1 in its own process; rank 0 in another, printing its tokens.
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.llama_models", args[0], str(rank), *args[1:]],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 0)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0]
    tp2 = json.loads(outputs[1])
    tp1 = run_rank(folder, 0, 1, "", REQUESTS)
    assert tp2 == tp1
    for request, tokens in zip(REQUESTS[:3], tp1[:3]):
        assert tokens == hf_greedy(folder, request["prompt_token_ids"], request["max_tokens"])
