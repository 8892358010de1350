"""`cadence serve --engine transformers --model PATH`: any causal LM that transformers loads
from a local folder, served as a model class of cadence's public API (docs/models.md, "Any
transformers model"); `--engine transformers` is this class behind `--engine MODULE:CLASS`.

Each step prefills the new sequences in one forward (their prompts left-padded, with the
attention mask and each row's own position ids) into a transformers `DynamicCache`, then
decodes every running sequence in one batched forward over a left-padded batch of their
caches (cadence.engines.transformers_rows). The decode batch is kept from step to step and
rebuilt only when its sequences change (one joined, left, or was paused).

Why not transformers' own continuous batching (`ContinuousBatchingManager`, paged
attention): it runs its own generation thread and scheduler, which decides which requests
run in a step, splits long prefills over several steps and may hold a request back while the
paged cache is full; cadence's step contract is one output for every sequence it hands in,
from a loop that cadence's scheduler owns. Two schedulers would fight over the same requests.

Sampling is the torch engine's (cadence.engines.llama.sampling): greedy at temperature 0,
else temperature / top-k / top-p with one generator per sequence seeded from the request.
The model's generation_config is read for its end-of-sequence ids only.
"""

from __future__ import annotations

import inspect

import torch

from cadence.engines.base import Sequence
from cadence.engines.llama.sampling import Sampler, sample
from cadence.engines.transformers_rows import Rows, new_cache, unsupported_layers, zero_padding

TRANSFORMERS_MODEL = "cadence.engines.transformers_model:TransformersModel"
"""What `--engine transformers` serves (as `--engine MODULE:CLASS`)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _SeqState:
    """What the model keeps per sequence (`Sequence.state`)."""

    __slots__ = ("sampler", "last", "length", "cache", "row")

    def __init__(self, sampler: Sampler, cache, row: int, length: int) -> None:
        self.sampler = sampler
        self.last = 0
        """The sequence's newest token: the next forward's input."""
        self.length = length
        """Tokens in its cache (the prompt and every output but the newest)."""
        self.cache = cache
        """The cache that holds its keys and values: its step's prefill batch, the decode
        batch, or one of its own (copied out of the decode batch while it is paused)."""
        self.row = row
        """Its row in `cache`; its tokens are that row's last `length` columns."""


def _state(seq: Sequence) -> _SeqState:
    """What the model keeps for `seq`, which it has prefilled."""
    state = seq.state
    assert isinstance(state, _SeqState), "a sequence this model never prefilled"
    return state


class TransformersModel:
    """A transformers causal LM stepped as a batch (see the module docstring)."""

    def __init__(self, device: str, *, model: str = "", dtype: str = "auto") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not model:
            raise ValueError(
                "--engine transformers needs --model PATH (a local folder that "
                "transformers' AutoModelForCausalLM loads)"
            )
        torch_dtype = _DTYPES.get(dtype) or ("auto" if device.startswith("cuda") else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(
            model, local_files_only=True, dtype=torch_dtype
        )
        # transformers' @wraps(Module.to) types `to` unbound
        self.model = loaded.to(device).eval()  # type: ignore[arg-type]
        self.config = self.model.config
        problems = unsupported_layers(self.config)
        if problems:
            raise ValueError(
                f"{model}: its {', '.join(problems)} layers are not batched by "
                "--engine transformers (full and sliding-window attention are)"
            )
        self.device = torch.device(device)
        text = self.config.get_text_config(decoder=True)
        self.context = (
            getattr(text, "max_position_embeddings", None)
            or getattr(text, "n_positions", None)
            or 0
        )
        """Positions the model has (0: no limit known); a sequence that reaches it stops."""
        self._eos = frozenset(_eos_ids(self.model))
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache (the old name is deprecated).
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._rows: Rows | None = None
        self._batch: list[Sequence] = []
        """The sequences of `_rows`, in row order."""
        self._live = 0
        """Sequences of `_batch` not yet released."""

    def check(self, seq: Sequence) -> str | None:
        n = len(seq.prompt_token_ids)
        if n == 0:
            return "the prompt is empty; the model needs at least one token"
        if self.context and n >= self.context:
            return f"the prompt has {n} tokens; the model's context is {self.context}"
        return None

    @torch.inference_mode()
    def step(self, prefill: list[Sequence], decode: list[Sequence]) -> list[int | None]:
        logits = [self._prefill(prefill)] if prefill else []
        running = decode
        if self.context:  # out of positions: those end (None) rather than index past the model
            running = [s for s in decode if _state(s).length < self.context]
        if running:
            logits.append(self._decode(running))
        stepped = prefill + running
        tokens = (
            sample(torch.cat(logits).float(), [_state(s).sampler for s in stepped])
            if (logits)
            else []
        )
        for seq, token in zip(stepped, tokens):
            _state(seq).last = token
        if len(running) == len(decode):
            return list(tokens)  # (a list[int | None], as the step's type is)
        out = dict(zip(map(id, stepped), tokens))
        return [out.get(id(s)) for s in prefill + decode]

    def release(self, seq: Sequence) -> None:
        state = seq.state
        if not isinstance(state, _SeqState):  # (None: never prefilled, or released already)
            return
        seq.state = None
        if self._rows is not None and state.cache is self._rows.cache:
            self._live -= 1
            if self._live == 0:  # the batch's memory goes now, not at the next step
                self._rows, self._batch = None, []

    def _prefill(self, prefill: list[Sequence]) -> torch.Tensor:
        lengths = [len(s.prompt_token_ids) for s in prefill]
        width = max(lengths)
        ids = torch.zeros((len(prefill), width), dtype=torch.long)  # 0: padding, masked out
        mask = torch.zeros_like(ids)
        for i, (seq, n) in enumerate(zip(prefill, lengths)):
            ids[i, width - n :] = torch.tensor(seq.prompt_token_ids)
            mask[i, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = new_cache(self.config)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        if min(lengths) < width:
            zero_padding(cache, mask.to(self.device))
        for row, (seq, n) in enumerate(zip(prefill, lengths)):
            if self._eos:
                seq.stop_token_ids = seq.stop_token_ids | self._eos
            seq.state = _SeqState(Sampler(seq.sampling, 0, self.device), cache, row, n)
        return out.logits[:, -1]

    def _decode(self, decode: list[Sequence]) -> torch.Tensor:
        if decode != self._batch:
            self._regroup(decode)
        rows = self._rows
        assert rows is not None  # _regroup made it
        ids = torch.tensor([[_state(s).last] for s in decode], device=self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=rows.mask,
            position_ids=rows.positions,
            use_cache=True,
            **{self._cache_arg: rows.cache},
        )
        rows.advanced()
        for seq in decode:
            _state(seq).length += 1
        return out.logits[:, -1]

    def _regroup(self, decode: list[Sequence]) -> None:
        """Rebuild the decode batch from the rows of `decode`'s caches. A sequence of the old
        batch not in `decode` and not released (paused) gets its row copied out first."""
        old = self._rows
        keep = set(map(id, decode))
        for seq in self._batch:
            state = seq.state
            if isinstance(state, _SeqState) and id(seq) not in keep:  # (else None: released)
                assert old is not None  # `_batch` is the sequences of `_rows`
                state.cache = old.row_cache(self.config, state.row, state.length)
                state.row = 0
        states = [_state(s) for s in decode]
        rows = self._rows = Rows(
            self.config, [(s.cache, s.row) for s in states], [s.length for s in states]
        )
        for row, state in enumerate(states):
            state.cache, state.row = rows.cache, row
        self._batch = list(decode)
        self._live = len(decode)


def _eos_ids(model) -> list[int]:
    """The model's end-of-sequence ids: its generation_config's, else its config's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
