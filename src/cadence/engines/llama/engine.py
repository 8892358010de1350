"""`LlamaEngine`: the Engine protocol over a Llama model, its paged KV cache and its sampler.

Each step prefills the sequences admitted at that step boundary (prompts of any lengths)
and decodes one token for every running sequence, in one pass through the model. A sequence
gets its cache blocks when it is admitted (`reserve`) and gives them back when it finishes or
is cancelled (`release`), or is preempted (`preempt`: recomputed when admitted again). With
prefix caching, `reserve` first takes the cached blocks of the prompt's longest known prefix
(cadence.engines.llama.kv_cache), and every block a step fills is registered for later
requests. With tensor parallelism, this object on rank 0 plans each step and
broadcasts the plan; on the other ranks `follow` runs the same steps until rank 0 stops.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
import torch

from cadence.config import EngineConfig
from cadence.engines.base import Sequence
from cadence.engines.detokenizer import ByteText
from cadence.engines.engine import Engine
from cadence.engines.llama.decode_graphs import DecodeGraphs
from cadence.engines.llama.kv_cache import KVCache
from cadence.engines.llama.loader import TINY, load_weights, read_config
from cadence.engines.llama.model import LlamaModel, Shard, check_shardable
from cadence.engines.llama.parallel import TensorParallelGroup
from cadence.engines.llama.plan import StepPlan, unpack
from cadence.engines.llama.sampling import Sampler, sample
from cadence.engines.llama.tokenizer import TextTokenizer, load_tokenizer
from cadence.prefix_hash import BLOCK, ROOT, block_hashes
from cadence.vocabulary import AddRequest
from cadence.wording import counted

log = logging.getLogger("cadence.engine.torch")

BLOCK_SIZE = BLOCK
"""Tokens per KV-cache block."""

PREFILL_BUDGET = 4096
"""Padded prompt tokens (prompts x longest prompt) admitted into one step at most, so a burst
of long prompts cannot make one step's attention arbitrarily large; a single prompt longer
than this is still admitted alone."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`cpu` or `cuda:N` as a torch.device, made current for CUDA; a clear error if absent."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device} was asked for, but torch sees no CUDA card")
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device {device} does not exist ({counted(torch.cuda.device_count(), 'card')})"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise RuntimeError(f"device must be cpu or cuda:N, got {device!r}")
    return dev


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype: as asked, or `auto` (float32 on CPU, the checkpoint's on CUDA)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(checkpoint_dtype, torch.float32)
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def _extend_hashes(hashes: list[bytes], tokens: list[int], blocks: int) -> list[bytes]:
    """`hashes`, the chained hashes of the first blocks of `tokens`, extended in place to
    `blocks` blocks (hashing only the blocks it lacks)."""
    known = len(hashes)
    if known < blocks:
        hashes += block_hashes(
            tokens[known * BLOCK_SIZE : blocks * BLOCK_SIZE],
            BLOCK_SIZE,
            blocks - known,
            hashes[-1] if hashes else ROOT,
        )
    return hashes


class _SeqState:
    """What the engine holds for one sequence, from its first try at admission (`reserve`)."""

    __slots__ = ("blocks", "cached", "hashes", "last", "registered", "sampler", "tokens")

    def __init__(self, sampler: Sampler, tokens: list[int]) -> None:
        self.blocks: list[int] = []
        """Its cache blocks; empty until admitted (and after a preemption)."""
        self.cached = 0
        """Tokens whose keys and values are in the cache."""
        self.last = -1
        """The newest token: the input of the next decode step."""
        self.sampler = sampler
        """Kept across a preemption, so seeded sampling goes on where it was."""
        self.tokens = tokens
        """Every token of the sequence so far: what it prefills, then each output."""
        self.hashes: list[bytes] = []
        """Prefix caching: the chained hashes of its full blocks known so far."""
        self.registered = 0
        """Prefix caching: its leading blocks registered in (or taken from) the cache."""


class _MovedState(msgspec.Struct, array_like=True):
    """A sequence's state between two workers (disaggregated serving)."""

    tokens: list[int]
    """The prompt and the outputs so far; the last one is the next decode step's input."""
    cached: int
    """Tokens whose keys and values follow."""
    dtype: str
    shape: list[int]
    """Of `keys` and `values`: [layers, cached, kv_heads, head_dim]."""
    keys: bytes
    values: bytes
    generator: bytes
    """The sampler's random state (empty: greedy)."""


_encode_state = msgspec.msgpack.Encoder().encode
_decode_state = msgspec.msgpack.Decoder(_MovedState).decode


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes (any dtype, bfloat16 too), copied to the host."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    return flat.view(torch.uint8).numpy().tobytes()


def _tensor(
    data: bytes, dtype: torch.dtype, shape: list[int], device: torch.device
) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def _state(seq: Sequence) -> _SeqState:
    """What the engine holds for `seq`, which it has already seen (`reserve`)."""
    state = seq.state
    assert isinstance(state, _SeqState), "a sequence this engine never reserved"
    return state


class LlamaEngine(Engine):
    """A Llama-family model (or one tensor-parallel rank of it) with continuous batching."""

    name = "torch"
    takes_prefill_chunks = True
    """Under a step budget a long prompt comes in chunks: each appends to the sequence's
    paged KV and attends to everything before it (cadence.engines.llama.plan)."""

    def __init__(
        self,
        config: EngineConfig,
        device: str,
        *,
        rank: int = 0,
        group_size: int = 1,
        dist_init: str = "",
    ) -> None:
        if config.threads > 0 and device.startswith("cpu"):
            torch.set_num_threads(config.threads)
        self.device = resolve_device(device)
        self.rank = rank
        self._seed = config.seed
        if not config.model:
            raise ValueError(
                "the torch engine needs --model PATH (a local Hugging Face folder) or tiny"
            )
        self.model_config = read_config(config.model)
        check_shardable(self.model_config, group_size)
        self.dtype = resolve_dtype(config.dtype, self.model_config.dtype, self.device)
        self.group: TensorParallelGroup | None = None
        if group_size > 1:
            self.group = TensorParallelGroup(rank, group_size, dist_init, self.device)
        shard = Shard(rank, group_size)
        weights = load_weights(
            config.model,
            self.model_config,
            shard=shard,
            device=self.device,
            dtype=self.dtype,
            seed=config.seed,
            lm_head=rank == 0,
        )
        self.model = LlamaModel(
            self.model_config,
            weights,
            shard=shard,
            context=self.model_config.max_position,
            all_reduce=self.group.all_reduce if self.group else None,
        )
        self.cache = KVCache(
            layers=self.model_config.num_layers,
            kv_heads=self.model.kv_heads,
            head_dim=self.model_config.head_dim,
            capacity_tokens=config.kv_cache_tokens,
            block_size=BLOCK_SIZE,
            dtype=self.dtype,
            device=self.device,
        )
        self.graphs: DecodeGraphs | None = None
        """CUDA graphs for decode steps (CUDA, one rank, --cuda-graph-batch > 0)."""
        if self.device.type == "cuda" and group_size == 1 and config.cuda_graph_batch > 0:
            self.graphs = DecodeGraphs(
                self.model, self.cache, max_batch=config.cuda_graph_batch, capture=True
            )
        self.tokenizer: TextTokenizer | ByteText | None = None
        """The model folder's tokenizer, or byte-level text (`tiny`, no tokenizer.json); the
        worker tokenizes text prompts and detokenizes output with it (rank 0 only)."""
        if rank == 0:
            self.tokenizer = (
                ByteText() if config.model == TINY else load_tokenizer(Path(config.model))
            )
        self.vocab_size = self.model_config.vocab_size
        self.context = self.model_config.max_position
        self._eos = frozenset(self.model_config.eos_token_ids)
        self._prefix_caching = config.prefix_caching
        self.first_step_ms = 0.0
        self.warm_step_ms = 0.0
        self._admitted = 0
        """Prompts reserved for the coming step, and the longest of them (prefill budget)."""
        self._admitted_width = 0

    # -- the Engine protocol ------------------------------------------------------------------

    def start(self) -> None:
        """Warm up: run prefill and decode steps of a throw-away batch through every code path
        (one prompt, several prompts, batched decode), so the first request does not pay for
        first-touch allocations and kernel selection."""
        if self.rank != 0:
            return
        prompts = [[1] * 16, [2] * 7, [3] * 12]
        fake = [Sequence(AddRequest(-1 - i, p, 4)) for i, p in enumerate(prompts)]
        for seq in fake:
            if not self.reserve(seq):
                break
        else:
            start = time.perf_counter()
            self.step([fake[0]], [])
            self.first_step_ms = (time.perf_counter() - start) * 1e3
            self.step(fake[1:], [fake[0]])
            self.step([], fake)
            start = time.perf_counter()
            self.step([], fake)
            self.warm_step_ms = (time.perf_counter() - start) * 1e3
        for seq in fake:
            self.release(seq)
        self.cache.forget_prefixes()
        if self.graphs is not None:
            self.graphs.warm_up()

    def check(self, seq: Sequence) -> str | None:
        """Why the request cannot run here (token ids, context, cache capacity), or None."""
        request = seq.request
        prompt = request.prompt_token_ids
        if not prompt:
            return "the prompt has no tokens"
        vocab = self.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad = next(t for t in prompt if not 0 <= t < vocab)
            return f"prompt_token_ids must be in [0, {vocab}) for this model; got {bad}"
        need = len(prompt) + request.max_tokens - 1
        if need > self.context:
            return (
                f"the prompt ({counted(len(prompt), 'token')}) plus max_tokens "
                f"({request.max_tokens}) exceeds the model's context of "
                f"{counted(self.context, 'token')}; shorten the prompt or lower max_tokens"
            )
        if need > self.cache.capacity_tokens:
            return (
                f"the request needs {counted(need, 'token')} of KV cache but this worker's "
                f"cache holds {self.cache.capacity_tokens:,} (--kv-cache-tokens); lower max_tokens"
            )
        return None

    def reserve(self, seq: Sequence) -> bool:
        """Take the cache blocks `seq` can need (with prefix caching, the cached ones of its
        longest known prefix first: `seq.prefilled` says how many tokens they hold); False
        (nothing taken) when the cache is full for now (it waits for others to finish) or
        this step's prefill budget is spent."""
        request = seq.request
        chunk = seq.prefill_to - seq.prefilled  # the whole prompt unless chunked
        width = max(self._admitted_width, chunk)
        if self._admitted and (self._admitted + 1) * width > PREFILL_BUDGET:
            return False  # next step: this one's prefill is full
        state = seq.state
        if state is None:
            state = seq.state = _SeqState(
                Sampler(seq.sampling, self._seed, self.device), list(seq.prefill_ids)
            )
            if self._eos:
                seq.stop_token_ids = seq.stop_token_ids | self._eos
        assert isinstance(state, _SeqState)  # `state` is only ever set by this engine
        cache = self.cache
        need = cache.blocks_for(len(request.prompt_token_ids) + request.max_tokens - 1)
        held: list[int] = []
        if self._prefix_caching:
            ids = state.tokens
            # Whole blocks short of the last token: its logits come from a prefill. A
            # preempted sequence keeps the hashes of the blocks it had filled.
            _extend_hashes(state.hashes, ids, (len(ids) - 1) // BLOCK_SIZE)
            held = cache.match(state.hashes)
        fresh = cache.allocate_blocks(need - len(held))
        if fresh is None:
            if held:
                cache.free(held)
            return False
        state.blocks = held + fresh
        state.cached = state.registered = len(held)
        state.cached *= BLOCK_SIZE
        seq.prefilled = state.cached
        self._admitted += 1
        self._admitted_width = width
        return True

    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> list[int]:
        """Prefill the admitted sequences (or their chunks) and decode the running ones; one
        token each (none that means anything for a chunk that does not end its prompt)."""
        self._admitted = self._admitted_width = 0
        bs = BLOCK_SIZE
        prompts: list[list[int]] = []
        prefill_blocks: list[list[int]] = []
        starts: list[int] = []
        chunks = 0  # prefills that do not end their prompt: nothing to sample for them
        for seq in prefill:
            prompt = seq.prefill_ids
            begin, end = seq.prefilled, seq.prefill_to
            if begin or end < len(prompt):
                chunks += end < len(prompt)
                prompt = prompt[begin:end]
            prompts.append(prompt)
            starts.append(begin)
            prefill_blocks.append(_state(seq).blocks[: -(-end // bs)])
        states = [_state(seq) for seq in decode]
        plan = StepPlan(
            prompts,
            prefill_blocks,
            [s.last for s in states],
            [s.cached for s in states],
            [s.blocks[: s.cached // bs + 1] for s in states],
            starts,
        )
        packed = plan.pack()
        if self.group is not None:
            self.group.send_plan(packed)
        inputs = unpack(packed, bs, self.device)
        if self.graphs is not None and self.graphs.fits(inputs):
            logits = self.graphs.run(inputs)
        else:
            logits = self.model.forward(inputs, self.cache)
        assert logits is not None  # rank 0 computes logits (only followers get None)
        if chunks:
            # Sample only the sequences whose prompt ends here (a sampler's random state
            # must advance once per output token, chunked or not).
            ends = [i for i, seq in enumerate(prefill) if seq.prefill_to == len(seq.prefill_ids)]
            rows = ends + list(range(len(prefill), len(prefill) + len(decode)))
            sampled = sample(
                logits[rows],
                [_state(prefill[i]).sampler for i in ends] + [s.sampler for s in states],
            )
            tokens = [-1] * len(prefill) + sampled[len(ends) :]
            for i, token in zip(ends, sampled):
                tokens[i] = token
        else:
            samplers = [_state(seq).sampler for seq in prefill] + [s.sampler for s in states]
            tokens = sample(logits, samplers)
        caching = self._prefix_caching
        for seq, token in zip(prefill, tokens):
            state = _state(seq)
            state.cached = seq.prefill_to
            if state.cached == len(seq.prefill_ids):
                state.last = token
                state.tokens.append(token)
            if caching and state.cached >= (state.registered + 1) * bs:
                self._register(state)
        for state, token in zip(states, tokens[len(prefill) :]):
            state.cached += 1
            state.last = token
            state.tokens.append(token)
            if caching and state.cached >= (state.registered + 1) * bs:
                self._register(state)
        return tokens

    def _register(self, state: _SeqState) -> None:
        """Offer the sequence's newly filled blocks to the prefix cache."""
        full = state.cached // BLOCK_SIZE
        hashes = _extend_hashes(state.hashes, state.tokens, full)
        blocks, register = state.blocks, self.cache.register
        for i in range(state.registered, full):
            register(blocks[i], hashes[i])
        state.registered = full

    def kv_cache_usage(self) -> float:
        return self.cache.usage

    # -- disaggregated serving ----------------------------------------------------------------

    def export_state(self, seq: Sequence) -> bytes:
        """The sequence's keys and values (every layer, every cached token), its tokens and
        its sampler's random state, as bytes for a decode worker's `import_state`."""
        state = _state(seq)
        cache = self.cache
        slots = self._slots(state.blocks, state.cached)
        keys = torch.stack([k[slots] for k in cache.keys])
        values = torch.stack([v[slots] for v in cache.values])
        generator = state.sampler.generator
        return _encode_state(
            _MovedState(
                state.tokens,
                state.cached,
                str(keys.dtype).removeprefix("torch."),
                list(keys.shape),
                _tensor_bytes(keys),
                _tensor_bytes(values),
                b"" if generator is None else _tensor_bytes(generator.get_state()),
            )
        )

    def import_state(self, seq: Sequence, data: bytes) -> bool:
        """Take a sequence another worker prefilled: blocks for all it can need (False, and
        nothing taken, while the cache has too few free), its keys and values written into
        them; it decodes from its last token as if it had been prefilled here."""
        moved = _decode_state(data)
        request = seq.request
        cache = self.cache
        blocks = cache.allocate_blocks(
            cache.blocks_for(len(request.prompt_token_ids) + request.max_tokens - 1)
        )
        if blocks is None:
            return False
        try:
            self._write_state(moved, blocks)
        except BaseException:
            cache.free(blocks)  # nothing taken: the scheduler fails the sequence alone
            raise
        sampler = Sampler(seq.sampling, self._seed, self.device)
        if moved.generator and sampler.generator is not None:
            sampler.generator.set_state(
                torch.frombuffer(bytearray(moved.generator), dtype=torch.uint8)
            )
        state = _SeqState(sampler, list(moved.tokens))
        state.blocks = blocks
        state.cached = moved.cached
        state.last = moved.tokens[-1]
        seq.state = state
        if self._eos:
            seq.stop_token_ids = seq.stop_token_ids | self._eos
        if self._prefix_caching and state.cached >= BLOCK_SIZE:
            self._register(state)
        return True

    def _slots(self, blocks: list[int], tokens: int) -> torch.Tensor:
        """The cache slots of a sequence's first `tokens` tokens, in order."""
        bs = BLOCK_SIZE
        positions = torch.arange(tokens)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[positions // bs] * bs + positions % bs).to(self.device)

    def _write_state(self, moved: _MovedState, blocks: list[int]) -> None:
        """Write a handed-over sequence's keys and values into its new blocks."""
        dtype = _DTYPES[moved.dtype]
        if dtype != self.dtype:
            raise ValueError(
                f"a state in {moved.dtype} cannot join a cache in {self.dtype}: serve every "
                "worker with one --dtype"
            )
        cache = self.cache
        keys = _tensor(moved.keys, dtype, moved.shape, self.device)
        values = _tensor(moved.values, dtype, moved.shape, self.device)
        slots = self._slots(blocks, moved.cached)
        for layer in range(len(cache.keys)):
            cache.keys[layer][slots] = keys[layer]
            cache.values[layer][slots] = values[layer]

    def release(self, seq: Sequence) -> None:
        """Give the sequence's cache blocks back at once."""
        state = seq.state
        if isinstance(state, _SeqState):
            self.cache.free(state.blocks)
            seq.state = None

    def preempt(self, seq: Sequence) -> list[int]:
        """Give the sequence's blocks back but keep its sampler; it is prefilled again, its
        prompt and outputs so far, when admitted again (from the prefix cache, if on and its
        blocks were not evicted meanwhile)."""
        state = _state(seq)
        self.cache.free(state.blocks)
        state.blocks = []
        state.cached = state.registered = 0
        return list(state.tokens)

    # -- tensor parallelism -------------------------------------------------------------------

    def follow(self) -> None:
        """Followers (rank > 0): run every step rank 0 plans, until it stops the group."""
        assert self.group is not None and self.rank > 0
        try:
            while (packed := self.group.receive_plan()) is not None:
                self.model.forward(unpack(packed, BLOCK_SIZE, self.device), self.cache)
        finally:
            self.group.close()

    def close(self) -> None:
        """Rank 0: stop the followers and leave the group."""
        if self.group is not None and self.rank == 0:
            try:
                self.group.stop()
            except Exception:
                pass
            finally:
                self.group.close()
