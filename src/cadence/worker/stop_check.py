"""Whether an output ends its sequence: the one decision of STOP (a stop token) and LENGTH
(`max_tokens` outputs), for every worker, as vLLM's `check_stop`.

The batch scheduler asks it of each output of a step, the app runner of each token of a
piece (`stop_in_piece`). A model's own end, a None output of a batched model or an app's
function that returns, is the model's to say and reported where it happens (finish STOP).
"""

from __future__ import annotations

from collections.abc import Container

from cadence.vocabulary import Finish

# Module globals: an enum member's lookup on its class costs more than the check itself.
_STOP, _LENGTH, _NONE = Finish.STOP, Finish.LENGTH, Finish.NONE


def check_stop(
    token: int | None, generated: int, max_tokens: int, stop_token_ids: Container[int]
) -> Finish:
    """How the sequence ends with its output `token` (None: a text piece, which no stop token
    matches), its `generated`-th: STOP when the token is one of `stop_token_ids` (the token
    itself is sent), else LENGTH at `max_tokens` outputs, else NONE (it goes on). A stop
    token at the last allowed output is STOP."""
    if token is not None and token in stop_token_ids:
        return _STOP
    if generated >= max_tokens:
        return _LENGTH
    return _NONE


def stop_in_piece(
    tokens: list[int], generated: int, max_tokens: int, stop_token_ids: Container[int]
) -> tuple[int, Finish]:
    """How many of a piece's `tokens` (each one output, the sequence having `generated`
    before them) are sent, and how the sequence ends: `check_stop` of each token in turn, up
    to the first that ends it. Without stop tokens only the last token within `max_tokens`
    can end it, so it alone is checked."""
    sent = min(len(tokens), max_tokens - generated)
    if stop_token_ids:
        for i in range(sent):
            finish = check_stop(tokens[i], generated + i + 1, max_tokens, stop_token_ids)
            if finish:
                return i + 1, finish
        return sent, Finish.NONE
    return sent, check_stop(None, generated + sent, max_tokens, stop_token_ids)
