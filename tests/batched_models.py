"""Batched model classes that the model-engine tests serve (`cadence serve --engine
tests.batched_models:NAME`).

Worker processes import this module by name, so it must stay importable from the repository
root (the tests put the root on PYTHONPATH). `EchoModel` reads its instructions from each
sequence's prompt (first word):

- `count N`: the digits 0123456789 0123... as byte tokens, N of them, then done (None);
- `batch`: each output is the text "<sequences in this step> ";
- `record PATH`: each output is the text "<step number> "; at release, appends
  "released after G outputs at step S" to PATH;
- `fail`: the step that gives this sequence its third output raises ValueError;
- `fail-alone`: its third output is a ValueError (this sequence fails, not its step);
- `refuse`: its third output is a `cadence.SequenceError` with status RESOURCE_EXHAUSTED;
- `hang`: the step that gives this sequence its third output never returns;
- anything else: the prompt's bytes, over and over.

Every step takes a fixed `STEP_S` whatever the batch, as a card's decode step nearly does.
"""

from __future__ import annotations

import codecs
import os
import time

import cadence

STEP_S = 0.01


class EchoModel:
    """A deterministic byte-token model: no tokenizer, so outputs are bytes or text."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.steps = 0

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]) -> list:
        self.steps += 1
        for seq in prefill:
            words = seq.prompt.split()
            seq.state = (words[0] if words else "", words[1:])
        batch = prefill + decode
        for seq in batch:
            command = seq.state[0]
            if command == "fail" and seq.generated == 2:
                raise ValueError("failed on purpose")
            if command == "hang" and seq.generated == 2:
                time.sleep(3600)
        time.sleep(STEP_S)
        return [self._next(seq, len(batch)) for seq in batch]

    def _next(self, seq: cadence.Sequence, batch_size: int) -> int | str | Exception | None:
        command, args = seq.state
        if seq.generated == 2 and command in _FAILURES:
            return _FAILURES[command]()
        if command == "count":
            return None if seq.generated >= int(args[0]) else ord("0") + seq.generated % 10
        if command == "batch":
            return f"{batch_size} "
        if command == "record":
            return f"{self.steps} "
        prompt = seq.prompt_token_ids
        return prompt[seq.generated % len(prompt)]

    def release(self, seq: cadence.Sequence) -> None:
        command, args = seq.state
        if command == "record":
            with open(args[0], "a") as f:
                f.write(f"released after {seq.generated} outputs at step {self.steps}\n")


class MovableModel(EchoModel):
    """EchoModel whose sequences can move between workers (disaggregated serving): its state
    is the prompt's command and arguments."""

    def export_state(self, seq: cadence.Sequence) -> bytes:
        command, args = seq.state
        return " ".join([command, *args]).encode()

    def import_state(self, seq: cadence.Sequence, data: bytes) -> bool:
        words = data.decode().split()
        seq.state = (words[0] if words else "", words[1:])
        return True


class FragileImportModel(MovableModel):
    """MovableModel whose `import_state` raises on a prompt that starts with `unmovable`
    (a state the decode worker's engine cannot take)."""

    def import_state(self, seq: cadence.Sequence, data: bytes) -> bool:
        if data.startswith(b"unmovable"):
            raise ValueError("this state cannot be taken here")
        return super().import_state(seq, data)


class SickModel(EchoModel):
    """EchoModel on a card with a sticky error: in the worker numbered
    $SICK_MODEL_WORKER every step raises, as a CUDA context does after an illegal
    memory access, until the process is replaced. Its first start only: it leaves the file
    $SICK_MODEL_MARKER, and a replacement that finds it gets a healthy card."""

    def __init__(self, device: str, worker: int) -> None:
        super().__init__(device)
        marker = os.environ.get("SICK_MODEL_MARKER", "")
        self.sick = worker == int(os.environ.get("SICK_MODEL_WORKER", "-1")) and not (
            marker and os.path.exists(marker)
        )
        if self.sick and marker:
            open(marker, "w").close()

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]) -> list:
        if self.sick:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step(prefill, decode)

    def release(self, seq: cadence.Sequence) -> None:
        if seq.state is not None:  # a sequence whose first step failed has none
            super().release(seq)


_FAILURES = {
    "fail-alone": lambda: ValueError("failed on purpose"),
    "refuse": lambda: cadence.SequenceError("no room for this one", status="RESOURCE_EXHAUSTED"),
}
"""What a prompt's command puts in its sequence's place at its third output."""


class WordTokenizer:
    """Whole words as ids 1000 and up, every other byte as itself (byte fallback): encode
    and decode only, so cadence detokenizes incrementally."""

    WORDS = ("hello", "wörld", "cadence", "streams", " ")
    vocab_size = 1000 + len(WORDS)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        rest = text
        while rest:
            word = next((w for w in self.WORDS if rest.startswith(w)), None)
            if word is not None:
                ids.append(1000 + self.WORDS.index(word))
                rest = rest[len(word) :]
            else:
                ids += rest[0].encode()
                rest = rest[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        data = b"".join(self.WORDS[i - 1000].encode() if i >= 1000 else bytes((i,)) for i in ids)
        return data.decode("utf-8", errors="replace")


class VocabModel:
    """A model with its own vocabulary: it repeats its prompt's token ids (words above 255,
    bytes of the others), so split multi-byte characters come out as separate tokens."""

    tokenizer = WordTokenizer()

    def __init__(self, device: str) -> None:
        self.device = device

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]) -> list[int]:
        return [
            seq.prompt_token_ids[seq.generated % len(seq.prompt_token_ids)]
            for seq in prefill + decode
        ]


class PieceModel:
    """Every output a text piece of several UTF-8 bytes ("wörd7 ", the shape of a vocabulary
    cadence does not know), without a tokenizer: each piece is one output whose ids are its
    bytes."""

    def __init__(self, device: str) -> None:
        self.device = device

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]) -> list[str]:
        return [f"wörd{seq.generated} " for seq in prefill + decode]


class MisspelledModel(EchoModel):
    """EchoModel with two members cadence never calls, misspelled: `relase`, `max_batches`."""

    max_batches = 4

    def relase(self, seq: cadence.Sequence) -> None:
        raise AssertionError("never called")


class DeclaredModel(cadence.Model):
    """`cadence.Model`'s defaults, and a step: bytes of the prompt, over and over."""

    def __init__(self, device: str) -> None:
        pass

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]) -> list[int]:
        return [s.prompt_token_ids[s.generated % len(s.prompt_token_ids)] for s in prefill + decode]


class NoStepModel:
    def __init__(self, device: str) -> None:
        pass


class BrokenInitModel(EchoModel):
    def __init__(self, device: str) -> None:
        raise RuntimeError("no weights at /nowhere")


class GroupModel:
    """A tensor-parallel model: each step all-reduces a tensor over its ranks; outputs say
    what rank 0 learnt ("rank/size sum ")."""

    def __init__(self, device: str, rank: int, group_size: int) -> None:
        import torch
        import torch.distributed as dist

        assert dist.is_initialized() and dist.get_world_size() == group_size
        self.rank, self.group_size = rank, group_size
        self._torch, self._dist = torch, dist

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]) -> list[str]:
        batch = prefill + decode
        # Every rank steps the same sequences: the sum of their ids must agree.
        total = self._torch.tensor([float(self.rank + 1), float(sum(s.seq_id for s in batch))])
        self._dist.all_reduce(total)
        assert int(total[1]) == self.group_size * sum(s.seq_id for s in batch)
        return [f"{self.rank}/{self.group_size} {int(total[0])} " for _ in batch]


class StreamModel:
    """The batch-generator shape: one `generate_stream` per batch, one yield per step.

    Prompts as for EchoModel: `count N`, `batch` (the size of its batch when it started),
    `fail` (the generator raises at its third yield), `fail-alone` and `refuse` (its third
    output is an exception); anything else: its bytes, repeated."""

    def __init__(self, device: str) -> None:
        self.released: list[int] = []

    def generate_stream(self, batch: list[cadence.Sequence]):
        for step in range(10**6):
            time.sleep(STEP_S)
            if step == 2 and any(seq.prompt == "fail" for seq in batch):
                raise ValueError("generator failed on purpose")
            yield [self._output(seq, step, len(batch)) for seq in batch]

    @staticmethod
    def _output(seq: cadence.Sequence, step: int, size: int) -> int | str | Exception | None:
        words = seq.prompt.split()
        if step == 2 and words and words[0] in _FAILURES:
            return _FAILURES[words[0]]()
        if words and words[0] == "count":
            return None if step >= int(words[1]) else ord("0") + step % 10
        if words and words[0] == "batch":
            return f"{size} "
        return seq.prompt_token_ids[step % len(seq.prompt_token_ids)]


class BadOutputModel(EchoModel):
    """EchoModel whose prompts can also ask for outputs a model should not give:

    - `huge N`: each output is a text of N bytes;
    - `surrogate`: its third output is a text holding a lone surrogate ('\\ud800'), which
      no UTF-8 stream can carry;
    - `raising`: the step that gives its third output returns an iterator that raises."""

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]):
        outputs = super().step(prefill, decode)
        batch = prefill + decode
        for i, seq in enumerate(batch):
            command, args = seq.state
            if command == "huge":
                outputs[i] = "x" * int(args[0])
            elif command == "surrogate" and seq.generated == 2:
                outputs[i] = "\ud800"
            elif command == "raising" and seq.generated == 2:
                return _raising(outputs)
        return outputs


def _raising(outputs: list):
    yield from outputs[:1]
    raise RuntimeError("the outputs' iterator failed on purpose")


class BadTokenizer:
    """Byte ids (0..255) with its own incremental `stream`, and faults a model's or an app's
    tokenizer should not have: `encode` of a text holding "ENCODE-FAILS" raises; the
    stream's piece of id 1 raises, of id 2 is a lone surrogate ('\\ud800'), of id 3 is a
    text of 10,000,000 bytes."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        if "ENCODE-FAILS" in text:
            raise RuntimeError("the tokenizer's encode failed on purpose")
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream(self, prompt_ids: list[int]):
        def piece(token: int, final: bool = False) -> str:
            if token == 1:
                raise RuntimeError("the tokenizer's stream failed on purpose")
            if token == 2:
                return "\ud800"
            if token == 3:
                return "x" * 10_000_000
            return chr(token)

        return piece


class DecodeOnlyTokenizer(BadTokenizer):
    """BadTokenizer without `stream`, so cadence detokenizes with its `decode`, which raises
    on id 1."""

    stream = None

    def decode(self, ids: list[int]) -> str:
        if 1 in ids:
            raise RuntimeError("the tokenizer's decode failed on purpose")
        return super().decode(ids)


_THIRD_OUTPUTS = {
    "encode-fails": "ENCODE-FAILS",
    "stream-raises": 1,
    "stream-surrogate": 2,
    "stream-huge": 3,
}


class StreamOnlyTokenizer:
    """Byte ids with the least base's contract asks of a tokenizer: `encode` and its own
    `stream`, no `decode` (so a prompt sent as token ids has no text to give the model)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def stream(self, prompt_ids: list[int]):
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode

        def piece(token: int, final: bool = False) -> str:
            return decode(bytes((token,)), final)

        return piece


class StreamOnlyTokenizerModel(EchoModel):
    """EchoModel with StreamOnlyTokenizer (encode and stream, no decode)."""

    tokenizer = StreamOnlyTokenizer()


class BadTokenizerModel(EchoModel):
    """EchoModel with BadTokenizer: at its third output, a prompt `encode-fails` gives the
    text "ENCODE-FAILS", and `stream-raises`, `stream-surrogate`, `stream-huge` give ids
    1, 2 and 3."""

    tokenizer = BadTokenizer()

    def step(self, prefill: list[cadence.Sequence], decode: list[cadence.Sequence]) -> list:
        outputs = super().step(prefill, decode)
        for i, seq in enumerate(prefill + decode):
            if seq.generated == 2 and seq.state[0] in _THIRD_OUTPUTS:
                outputs[i] = _THIRD_OUTPUTS[seq.state[0]]
        return outputs


class DecodeOnlyTokenizerModel(BadTokenizerModel):
    """BadTokenizerModel whose tokenizer has only encode and decode (DecodeOnlyTokenizer)."""

    tokenizer = DecodeOnlyTokenizer()
