"""An app function and a batched model class with their own vocabulary (the tests' byte-level
BPE, tests/bpe_tokenizer.py: ids up to about 320, a split multi-byte character spread over
several tokens), served by tests/integration/test_own_vocabulary.py. Workers import this
module by name from the repository root.

Both give the same outputs: the prompt's token ids without the BOS, over and over, one per
step; for a prompt `say: TEXT`, the words of TEXT as `str` pieces (each with the space after
it), then done.
"""

from __future__ import annotations

from collections.abc import Iterator

import cadence
from tests.bpe_tokenizer import build_tokenizer

BPE = build_tokenizer()
BOS = 0


def output(prompt: str, prompt_ids: list[int], index: int) -> int | str | None:
    """The `index`-th output for this prompt (None: done)."""
    if prompt.startswith("say: "):
        words = prompt[5:].split(" ")
        return words[index] + " " if index < len(words) else None
    ids = [t for t in prompt_ids if t != BOS]
    return ids[index % len(ids)]


def echo_ids(request: cadence.AppRequest, context: cadence.AppContext) -> Iterator[str | list[int]]:
    for index in range(request.max_tokens):
        out = output(request.prompt, request.prompt_token_ids, index)
        if out is None:
            return
        yield out if type(out) is str else [out]


echo_ids.tokenizer = BPE


class EchoIdsModel:
    tokenizer = BPE

    def __init__(self, device: str) -> None:
        pass

    def step(
        self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]
    ) -> list[int | str | None]:
        return [output(s.prompt, s.prompt_token_ids, s.generated) for s in prefill + decode]
