"""`--engine transformers`: tiny random checkpoints of several architectures behind
ModelEngine, stepped by the real BatchScheduler, against transformers' own generate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")

from cadence.api.openai.chat import TemplateChat, chat_format
from cadence.config import EngineConfig, ServerConfig
from cadence.engines.transformers_model import TRANSFORMERS_MODEL
from cadence.engines.user_model import ModelEngine
from cadence.transport.messages import StepOutput, step_pieces
from cadence.vocabulary import AddRequest, Finish, Sampling
from cadence.worker.batch_scheduler import BatchScheduler
from cadence.worker.process import build_engine
from tests.llama_models import PROMPTS
from tests.transformers_models import ARCHITECTURES, generate_greedy, save_checkpoint

N = 20
"""Tokens per sequence: with the longest prompt, past the sliding window of 8."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("transformers")
    return {arch: save_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def prompt_ids(checkpoints) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoints["llama"])
    return [tok(p).input_ids for p in PROMPTS]


def engine(folder: Path, **config) -> ModelEngine:
    return build_engine(EngineConfig(name="transformers", model=str(folder), **config), "cpu")


def run(
    scheduler: BatchScheduler,
    joins: dict[int, list[AddRequest]],
    events: dict[int, Callable[[BatchScheduler], None]] | None = None,
) -> dict[int, tuple]:
    """Step until done; `joins[step]` are added and `events[step]` called before that step.
    Returns each sequence's (token ids, text, finish)."""
    events = events or {}
    tokens: dict[int, list[int]] = {r.seq_id: [] for rs in joins.values() for r in rs}
    texts = dict.fromkeys(tokens, "")
    finish = dict.fromkeys(tokens, Finish.NONE)
    step = 0
    while step <= max([*joins, *events]) or scheduler.has_work:
        for request in joins.get(step, []):
            assert scheduler.add(request) is None
        if step in events:
            events[step](scheduler)
        out = scheduler.step()
        step += 1
        if type(out) is not StepOutput:
            assert out is None, out
            continue
        for sid, piece, text in step_pieces(out):
            tokens[sid] += [piece] if type(piece) is int else piece
            texts[sid] += text
        for sid, reason in zip(out.finished_ids, out.finish_reasons):
            finish[sid] = reason
    return {sid: (tokens[sid], texts[sid], finish[sid]) for sid in tokens}


def staggered(prompt_ids: list[list[int]], max_tokens: int = N, **fields) -> dict:
    """The prompts joining at steps 0, 1, 1 and 4: continuous batching with different lengths."""
    req = [AddRequest(i, ids, max_tokens, **fields) for i, ids in enumerate(prompt_ids)]
    return {0: [req[0]], 1: [req[1], req[2]], 4: [req[3]]}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_equal_generate_with_sequences_joining_at_different_steps(
    arch, checkpoints, prompt_ids
) -> None:
    model = engine(checkpoints[arch])
    outs = run(BatchScheduler(model, 0, 16), staggered(prompt_ids))
    for i, ids in enumerate(prompt_ids):
        tokens, text, finish = outs[i]
        assert tokens == generate_greedy(checkpoints[arch], ids, N), (arch, i)
        assert text == model.tokenizer.decode(tokens)
        assert finish == Finish.LENGTH
    assert model.model._rows is None, "every release frees the decode batch"


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_paused_sequence_resumes_from_its_own_cache(arch, checkpoints, prompt_ids) -> None:
    # Sequence 2 leaves the batch for steps 3-7 (its row copied out) and comes back.
    outs = run(
        BatchScheduler(engine(checkpoints[arch]), 0, 16),
        staggered(prompt_ids),
        {3: lambda s: s.pause([2]), 8: lambda s: s.resume([2])},
    )
    for i, ids in enumerate(prompt_ids):
        assert outs[i][0] == generate_greedy(checkpoints[arch], ids, N), (arch, i)


def test_an_aborted_sequence_is_released_and_the_others_go_on(checkpoints, prompt_ids) -> None:
    model = engine(checkpoints["qwen2"])
    scheduler = BatchScheduler(model, 0, 16)
    seqs = []

    def abort(s: BatchScheduler) -> None:
        seqs.extend(s._running.values())
        s.abort([1])
        assert seqs[1].state is None

    outs = run(scheduler, staggered(prompt_ids), {3: abort})
    assert len(outs[1][0]) == 2 and outs[1][2] == Finish.NONE
    for i in (0, 2, 3):
        assert outs[i][0] == generate_greedy(checkpoints["qwen2"], prompt_ids[i], N)
    assert model.model._rows is None and all(s.state is None for s in seqs)


def test_max_batch_bounds_the_step_and_the_tokens_stay_generates(checkpoints, prompt_ids) -> None:
    model = engine(checkpoints["llama"], max_batch=2)
    assert model.max_batch == 2
    scheduler = BatchScheduler(model, 0, model.max_batch)
    sizes = []
    step = model.step

    def counted(prefill, decode):
        sizes.append(len(prefill) + len(decode))
        return step(prefill, decode)

    model.step = counted
    outs = run(scheduler, {0: [AddRequest(i, ids, 6) for i, ids in enumerate(prompt_ids)]})
    assert max(sizes) == 2
    for i, ids in enumerate(prompt_ids):
        assert outs[i][0] == generate_greedy(checkpoints["llama"], ids, 6)


def test_sampling_depends_on_the_seed_not_on_the_batch(checkpoints, prompt_ids) -> None:
    folder = checkpoints["llama"]
    sampled = {"temperature": 1.5, "top_p": 0.9, "top_k": 50}

    def alone(seed: int) -> list[int]:
        scheduler = BatchScheduler(engine(folder), 0, 16)
        request = AddRequest(0, prompt_ids[0], N, Sampling(seed=seed, **sampled))
        return run(scheduler, {0: [request]})[0][0]

    joins = staggered(prompt_ids, sampling=Sampling(seed=7, **sampled))
    together = run(BatchScheduler(engine(folder), 0, 16), joins)
    assert together[0][0] == alone(7)
    assert alone(7) != alone(8)
    assert together[0][0] != generate_greedy(folder, prompt_ids[0], N)


def test_eos_ends_a_sequence_with_stop(checkpoints, prompt_ids, tmp_path) -> None:
    # A checkpoint whose generation_config names the token greedy decoding picks first as EOS.
    from transformers import AutoModelForCausalLM

    first = generate_greedy(checkpoints["llama"], prompt_ids[0], 1)[0]
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    model.generation_config.eos_token_id = first
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoints["llama"] / name).read_bytes())
    outs = run(BatchScheduler(engine(tmp_path), 0, 16), {0: [AddRequest(0, prompt_ids[0], N)]})
    assert outs[0][0] == [first] and outs[0][2] == Finish.STOP


def test_a_sequence_that_reaches_the_context_stops(tmp_path, prompt_ids) -> None:
    model = engine(save_checkpoint(tmp_path, "gpt2", n_positions=16))
    scheduler = BatchScheduler(model, 0, 16)
    outs = run(scheduler, {0: [AddRequest(0, prompt_ids[0], N)]})
    assert len(prompt_ids[0]) + len(outs[0][0]) == 16 + 1 and outs[0][2] == Finish.STOP
    refused = scheduler.add(AddRequest(1, prompt_ids[2], N))
    assert refused is not None and "context is 16" in refused.message


def test_dtype_is_the_servers(checkpoints, prompt_ids) -> None:
    import torch

    model = engine(checkpoints["qwen3"], dtype="bfloat16")
    assert model.model.model.dtype == torch.bfloat16
    outs = run(BatchScheduler(model, 0, 16), {0: [AddRequest(0, prompt_ids[0], 4)]})
    assert len(outs[0][0]) == 4


def test_serve_resolves_transformers_to_the_model_class(checkpoints) -> None:
    from cadence.cli import _server_config, build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--engine",
            "transformers",
            "--model",
            str(checkpoints["phi3"]),
            "--dtype",
            "float32",
        ]
    )
    config = _server_config(args)
    assert config.engine.name == "transformers" and config.engine.tokenizes_text
    assert engine(checkpoints["phi3"]).name == TRANSFORMERS_MODEL
    with pytest.raises(ValueError, match="transformers engine needs a model"):
        ServerConfig(engine=EngineConfig(name="transformers"))


def test_chat_uses_the_folders_template(checkpoints) -> None:
    pytest.importorskip("jinja2", reason="chat templates need the torch extra's jinja2")
    folder = checkpoints["mistral"]
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    )
    chat = chat_format(ServerConfig(engine=EngineConfig(name="transformers", model=str(folder))))
    assert isinstance(chat, TemplateChat)
    assert chat.render([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"


def test_the_example_builds_a_folder_the_engine_serves(tmp_path) -> None:
    pytest.importorskip("jinja2", reason="chat templates need the torch extra's jinja2")
    from examples.transformers_model import build

    folder = build(tmp_path / "tiny-qwen3")
    model = engine(folder)
    prompt = model.tokenizer.encode("the quick brown fox")
    outs = run(BatchScheduler(model, 0, 16), {0: [AddRequest(0, prompt, 8)]})
    assert outs[0][0] == generate_greedy(folder, prompt, 8)
    chat = chat_format(ServerConfig(engine=EngineConfig(name="transformers", model=str(folder))))
    assert chat.render([{"role": "user", "content": "hi"}]) == "<|user|>hi<|assistant|>"
