"""Config variations of the Llama family: served like transformers, or refused by field name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch", reason="the torch extra: pip install 'cadence[torch]'")

import torch

from cadence.config import EngineConfig
from cadence.engines.llama.config import UnsupportedModel, from_hf
from cadence.engines.llama.engine import LlamaEngine
from cadence.engines.llama.kv_cache import KVCache
from cadence.engines.llama.loader import ModelFolderError, read_config
from cadence.engines.llama.tokenizer import TextTokenizer
from cadence.vocabulary import AddRequest, Sampling
from cadence.worker.batch_scheduler import BatchScheduler
from tests.llama_models import PROMPTS, hf_greedy, save_model, save_tokenizer

PROMPT_IDS = [
    [0, 17, 42, 99, 5, 250, 31],
    [0, 8],
    [0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
]
N = 10

VARIANTS = {
    "qwen2 q/k/v bias": {"arch": "qwen2"},
    "tied embeddings": {"tie_word_embeddings": True},
    "llama3 rope scaling": {
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "linear rope scaling and theta": {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}
    },
    "attention and mlp bias, explicit head_dim": {
        "attention_bias": True,
        "mlp_bias": True,
        "head_dim": 32,
    },
}


def greedy_batch(folder: Path) -> dict[int, list[int]]:
    engine = LlamaEngine(EngineConfig(name="torch", model=str(folder), kv_cache_tokens=1024), "cpu")
    scheduler = BatchScheduler(engine, 0, 8)
    for i, ids in enumerate(PROMPT_IDS):
        assert scheduler.add(AddRequest(i, ids, N)) is None
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPT_IDS))}
    while scheduler.has_work:
        out = scheduler.step()
        for seq_id, token in zip(out.seq_ids, out.token_ids):
            tokens[seq_id].append(token)
    return tokens


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_give_transformers_greedy_tokens(tmp_path, variant):
    folder = save_model(tmp_path / "m", tokenizer=False, **VARIANTS[variant])
    got = greedy_batch(folder)
    for i, ids in enumerate(PROMPT_IDS):
        assert got[i] == hf_greedy(folder, ids, N), f"{variant}: prompt {i}"


def _base() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
    }


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope_type",
        ),
        ({"model_type": "qwen2", "use_sliding_window": True}, "sliding_window"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(UnsupportedModel, match=field):
        from_hf({**_base(), **change})


def test_transformers_4_style_rope_fields_are_read():
    config = from_hf(
        {
            **_base(),
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert (config.rope.theta, config.rope.kind, config.rope.factor) == (500000.0, "llama3", 8.0)
    assert config.rope.original_max_position == 8192


def test_generation_config_eos_list_wins(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_base(), "eos_token_id": 2}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_config(str(folder)).eos_token_ids == (2, 7)


def test_a_folder_without_weights_or_config_says_what_is_missing(tmp_path):
    with pytest.raises(ModelFolderError, match="config.json"):
        read_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_base()))
    with pytest.raises(ModelFolderError, match="safetensors"):
        LlamaEngine(EngineConfig(name="torch", model=str(tmp_path)), "cpu")
    with pytest.raises(ValueError, match="not divisible by --tp 4"):
        LlamaEngine(EngineConfig(name="torch", model=str(tmp_path)), "cpu", group_size=4)


@pytest.mark.parametrize(
    "tokenizer_config", [{}, {"add_bos_token": False}, {"add_eos_token": True}]
)
@pytest.mark.parametrize("post_processor", [True, False])
def test_tokenizer_encodes_like_autotokenizer(tmp_path, tokenizer_config, post_processor):
    from transformers import AutoTokenizer

    folder = save_tokenizer(tmp_path)
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **tokenizer_config}))
    if not post_processor:
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["post_processor"] = None
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    ours, theirs = TextTokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for text in PROMPTS + ["<s> special </s> inside"]:
        assert ours.encode(text) == theirs(text).input_ids, (tokenizer_config, text)


def test_stream_decoding_holds_back_split_characters_and_flushes_at_the_end(tmp_path):
    folder = save_tokenizer(tmp_path)
    tok = TextTokenizer(folder)
    ids = tok.encode("héllo 你好 wörld")
    piece = tok.stream(ids[:1])
    pieces = [piece(t, i == len(ids) - 2) for i, t in enumerate(ids[1:])]
    assert "".join(pieces) == tok.decode(ids[1:])
    assert "\ufffd" not in "".join(pieces)
    # The first two of the three bytes of 你 (byte-level tokens 'ä', '½'): nothing until the
    # sequence ends, then what transformers' decode gives for them.
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(folder / "tokenizer.json"))
    split = [vocab.token_to_id(c) for c in ("ä", "½")]  # bytes 0xe4 0xbd in byte-level BPE
    piece = tok.stream(ids[:1])
    assert piece(split[0], False) == ""
    assert piece(split[1], True) == tok.decode(split) != ""


def test_kv_cache_allocates_whole_blocks_and_takes_them_back():
    cache = KVCache(
        layers=1,
        kv_heads=1,
        head_dim=2,
        capacity_tokens=64,
        block_size=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    a = cache.allocate(17)
    assert a == [0, 1] and cache.free_tokens == 32
    assert cache.allocate(33) is None and cache.free_tokens == 32
    b = cache.allocate(32)
    assert b == [2, 3] and cache.free_tokens == 0
    cache.free(a)
    assert cache.allocate(16) == [0]


def test_without_tokenizer_json_text_is_byte_level_and_larger_ids_have_no_text(tmp_path):
    folder = save_model(tmp_path / "m", tokenizer=False, vocab_size=300)
    engine = LlamaEngine(EngineConfig(name="torch", model=str(folder), kv_cache_tokens=256), "cpu")
    scheduler = BatchScheduler(engine, 0, 4)
    # Sampled hot, so that ids beyond the bytes come out too.
    assert (
        scheduler.add(AddRequest(1, [], 40, Sampling(temperature=5.0, seed=3), prompt_text="héllo"))
        is None
    )
    tokens, texts = [], []
    while scheduler.has_work:
        out = scheduler.step()
        tokens += out.token_ids
        texts += out.texts
        if out.prompt_lens:
            assert out.prompt_lens == {1: len("héllo".encode())}
    assert len(texts) == len(tokens) == 40
    assert any(t >= 256 for t in tokens)
    assert "".join(texts) == bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
