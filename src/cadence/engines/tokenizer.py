"""Moved to cadence.byte_tokenizer (the front imports no engine). Kept only for
cadence.lab.bench_cli, which is being restructured elsewhere: remove once it imports
cadence.byte_tokenizer."""

from cadence.byte_tokenizer import ByteTokenizer, StreamDecoder

__all__ = ["ByteTokenizer", "StreamDecoder"]
