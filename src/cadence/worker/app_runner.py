"""The app worker: serves a user's generator function on an event loop plus its own executor.

Where the batch worker (process.py) runs a step loop, an app worker runs an asyncio event
loop that owns every piece of state:

- inputs: the loop watches the input socket's file descriptor (`add_reader`), so adds and
  aborts are applied the moment they arrive; nothing polls;
- an async function runs on the loop, one task per request;
- a sync function runs on a dedicated `ThreadPoolExecutor` of `engine_threads` threads
  that only ever run the function: each `next()` of a request's generator is one job;
  when it returns, the thread hands the piece to the loop and takes the next job. A
  thread never waits for the network, and a request never holds a thread between pieces,
  so the threads serve requests' pieces in turn (FIFO) and a request blocked in one long
  piece holds exactly one thread;
- output: every piece produced during one event-loop tick, of every request, goes to the
  front as ONE `StepOutput` (flushed with `call_soon`, like the front's `WorkerLink`).

A request ends when its function returns (finish STOP), when `max_tokens` tokens were
yielded (LENGTH; the piece that crosses it is cut), after a stop token (STOP), on abort or
deadline (the function is closed at its next piece and `context.cancelled` is set at once;
an async function is cancelled at its current `await`), or when the function raises (the
stream alone ends with INTERNAL and the exception's type and text).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

from cadence import event_loop
from cadence.config import WorkerSpec
from cadence.engines.app import (
    App,
    AppContext,
    AppRequest,
    TokenizerFailed,
    is_async_app,
    load_app,
    piece_tokens,
)
from cadence.engines.detokenizer import piece_encoder, prompt_decoder, text_streams
from cadence.engines.output_text import MAX_OUTPUT_TOKENS, ids_problem, text_problem
from cadence.heap import settle_heap
from cadence.transport.messages import (
    RequestFailed,
    Shutdown,
    StepOutput,
    WorkerInputs,
    WorkerOutput,
    WorkerReady,
    boot_id,
)
from cadence.transport.sockets import OUTPUT_HWM
from cadence.transport.worker_to_fronts import worker_channel
from cadence.vocabulary import AddRequest, Failure, Finish
from cadence.worker.stop_check import stop_in_piece

log = logging.getLogger("cadence.app")

_CLOSE_GRACE_S = 2.0
"""On shutdown, how long running pieces and generators' clean-up get before the worker
exits without them."""
_END = object()
"""An executor job's result when the function returned."""


class _Raised:
    """An executor job's result when the function raised (a piece may be any object)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Seq:
    """One request inside the app worker."""

    __slots__ = (
        "busy",
        "context",
        "detokenize",
        "done",
        "generated",
        "iterator",
        "mark",
        "max_tokens",
        "parked",
        "paused",
        "prompt_len",
        "request",
        "resumed",
        "seq_id",
        "stop_token_ids",
        "task",
        "timer",
    )

    def __init__(self, request: AppRequest, context: AppContext) -> None:
        self.seq_id = request.seq_id
        self.request = request
        self.context = context
        self.max_tokens = request.max_tokens
        self.stop_token_ids = frozenset(request.sampling.stop_token_ids)
        self.generated = 0
        self.iterator: Iterator[object] | None = None
        """Sync: the function's iterator, once its first piece was asked for."""
        self.task: asyncio.Task | None = None
        self.busy = False
        """Sync: a job for this request is queued or running in the executor."""
        self.done = False
        """Finished, failed, cancelled or expired: no more output, close the function."""
        self.timer: asyncio.TimerHandle | None = None
        self.mark = -1
        """Async: the runner's flush count at this request's last piece."""
        self.paused = False
        """The client is not reading (the front's block policy): take no next piece."""
        self.parked = False
        """Sync: paused with no job queued; resume submits the next one."""
        self.resumed: asyncio.Future | None = None
        """Async: what a paused request's task waits on."""
        self.detokenize: Callable[[int, bool], str] | None = None
        """The function has a tokenizer: each output token's text (see detokenizer.py)."""
        self.prompt_len = -1
        """Prompt tokens of a text prompt the function's tokenizer encoded here, told to the
        front with the first piece (usage counts); -1: the front counted them."""


class AppRunner:
    """Drives a user's function for every request of one worker; see the module docstring.

    Must be created and used on the event loop that runs it. `send` delivers a message to
    the front (the worker's output socket).
    """

    def __init__(
        self,
        app: App,
        *,
        worker: int,
        device: str,
        threads: int,
        send: Callable[[WorkerOutput], None],
    ) -> None:
        self._app = app
        self._async = is_async_app(app)
        self._worker = worker
        self._device = device
        self._send = send
        self._loop = asyncio.get_running_loop()
        self._executor = (
            None
            if self._async
            else ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"cadence-app-{worker}")
        )
        self._seqs: dict[int, _Seq] = {}
        self._tasks: set[asyncio.Task] = set()
        self._jobs: set[Future] = set()
        # This tick's output, sent as one StepOutput by _flush.
        self._seq_ids: list[int] = []
        self._token_ids: list[int] = []
        self._counts: list[int] = []
        self._several = False
        self._finished: list[int] = []
        self._reasons: list[int] = []
        self._failures: list[RequestFailed] = []
        self._start_ns = 0
        self._end_ns = 0
        self._flush_scheduled = False
        self._flushes = 0
        self._steps = 0
        # Pieces that executor threads produced, waiting for the loop.
        self._completed: deque[tuple[_Seq, object, int, int]] = deque()
        self._wake_pending = False
        self._prompt_lens: dict[int, int] = {}
        tokenizer = getattr(app, "tokenizer", None)
        self._text = text_streams(tokenizer)
        """The function's own tokenizer (its `tokenizer` attribute), else bytes."""
        self._own_tokenizer = tokenizer is not None
        self._vocab_size: int | None = getattr(self._text, "vocab_size", None) or None
        self._encode_piece = piece_encoder(self._text) if tokenizer is not None else None
        self._decode_prompt = prompt_decoder(self._text)
        """Gives a prompt sent as token ids its text; None: such prompts are refused."""
        self._streams_with = getattr(self._text, "streams_with", "stream")
        """The tokenizer's method that a sequence's decoder calls (named when it raises)."""
        self._texts: list[str] = []
        """This tick's pieces' texts, with a tokenizer (the front decodes bytes itself)."""

    @property
    def active(self) -> int:
        """Requests not yet ended."""
        return len(self._seqs)

    # --- inputs -------------------------------------------------------------------------

    def apply(self, message: WorkerInputs) -> None:
        """Start the new requests, then cancel the aborted ones (both may be in one message),
        then pause and resume (the front's block overflow policy)."""
        for request in message.adds:
            self.add(request)
        for seq_id in message.aborts:
            self.abort(seq_id)
        for seq_id in message.pauses:
            self.pause(seq_id)
        for seq_id in message.resumes:
            self.resume(seq_id)

    def add(self, add: AddRequest) -> None:
        """Start the function for one request."""
        prompt = add.prompt_token_ids
        text = add.prompt_text
        prompt_len = -1
        if text and (self._own_tokenizer or not prompt):
            # A text prompt (beside its bytes, which the front counted): the function's
            # tokenizer encodes it.
            try:
                prompt = self._text.encode(text)
            except Exception as exc:
                self._refuse(add.seq_id, "encode", exc)
                return
            prompt_len = len(prompt) if self._own_tokenizer else -1
        vocab = self._vocab_size
        if prompt and not (0 <= min(prompt) and (vocab is None or max(prompt) < vocab)):
            bad = next(t for t in prompt if not 0 <= t < (vocab or t + 1))
            self._failures.append(
                RequestFailed(
                    add.seq_id,
                    Failure.INVALID_ARGUMENT,
                    f"prompt_token_ids must be in [0, {vocab}); got {bad}",
                )
            )
            self._schedule_flush()
            return
        if not text and prompt and self._decode_prompt is None:
            self._failures.append(
                RequestFailed(
                    add.seq_id,
                    Failure.INVALID_ARGUMENT,
                    "the app's tokenizer has no decode(ids), so the app cannot read a prompt sent "
                    "as token ids; send the prompt as text",
                )
            )
            self._schedule_flush()
            return
        request = AppRequest(
            seq_id=add.seq_id,
            prompt=text or self._decoded(prompt),
            prompt_token_ids=list(prompt),
            max_tokens=add.max_tokens,
            sampling=add.sampling,
            device=self._device,
        )
        context = AppContext(self._device, self._worker)
        seq = _Seq(request, context)
        if self._own_tokenizer:
            try:
                seq.detokenize = self._text.stream(request.prompt_token_ids)
            except Exception as exc:
                self._refuse(add.seq_id, "stream", exc)
                return
            seq.prompt_len = prompt_len
        self._seqs[seq.seq_id] = seq
        if add.timeout_ms > 0:
            context.deadline = time.monotonic() + add.timeout_ms / 1e3
            seq.timer = self._loop.call_later(add.timeout_ms / 1e3, self._expire, seq)
        if self._async:
            task = self._loop.create_task(self._drive(seq))
            seq.task = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._submit(seq)

    def _decoded(self, prompt: list[int]) -> str:
        """A prompt sent as token ids, as text (`add` refused it where there is no decoder)."""
        return self._decode_prompt(prompt) if self._decode_prompt is not None else ""

    def _refuse(self, seq_id: int, method: str, exc: Exception) -> None:
        """The function's tokenizer raised on a request's prompt: the request fails alone."""
        log.error(
            "the app's tokenizer.%s raised on request %d's prompt", method, seq_id, exc_info=exc
        )
        self._failures.append(
            RequestFailed(
                seq_id,
                Failure.INTERNAL,
                f"the app's tokenizer.{method} raised "
                f"{type(exc).__name__}: {exc} (on the prompt); fix the tokenizer",
            )
        )
        self._schedule_flush()

    def abort(self, seq_id: int) -> None:
        """The front gave up on the request (client cancel, deadline, drain): stop it."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._cancel(seq)

    def pause(self, seq_id: int) -> None:
        """The client stopped reading: take no further piece until `resume`."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.paused = True

    def resume(self, seq_id: int) -> None:
        """The client reads again: carry on with the function."""
        seq = self._seqs.get(seq_id)
        if seq is None or not seq.paused:
            return
        seq.paused = False
        if seq.parked:
            seq.parked = False
            self._submit(seq)
        if seq.resumed is not None and not seq.resumed.done():
            seq.resumed.set_result(None)

    def _expire(self, seq: _Seq) -> None:
        if not seq.done:
            self._failures.append(
                RequestFailed(
                    seq.seq_id,
                    Failure.DEADLINE_EXCEEDED,
                    "the request's deadline passed before generation finished",
                )
            )
            self._schedule_flush()
            self._cancel(seq)

    def _cancel(self, seq: _Seq) -> None:
        seq.context.cancel_event.set()
        self._end(seq)
        if seq.task is not None:
            # Interrupts the function at its current await; _drive then closes it.
            seq.task.cancel()
        elif not seq.busy:
            self._submit(seq)  # the job sees `done` and closes the generator

    def _end(self, seq: _Seq) -> None:
        """No more output for this request."""
        if not seq.done:
            seq.done = True
            del self._seqs[seq.seq_id]
            if seq.timer is not None:
                seq.timer.cancel()

    # --- async functions: one task per request on this loop -----------------------------

    async def _drive(self, seq: _Seq) -> None:
        monotonic_ns = time.monotonic_ns
        iterator = None
        try:
            start = monotonic_ns()
            result = self._app(seq.request, seq.context)
            if inspect.isawaitable(result):  # a coroutine function that returns an iterator
                result = await result
            if not isinstance(result, AsyncIterable):
                raise TypeError(
                    f"an async app must return an async iterator (an `async def` "
                    f"with `yield`), not a {type(result).__name__}"
                )
            iterator = result.__aiter__()
            anext = iterator.__anext__
            while True:
                if seq.paused:
                    seq.resumed = self._loop.create_future()
                    await seq.resumed
                    start = monotonic_ns()
                piece = await anext()
                if seq.mark == self._flushes:
                    # The function yielded again without suspending: let this tick end (and
                    # its piece go out) before taking the next, so it cannot hog the loop.
                    await asyncio.sleep(0)
                end = monotonic_ns()
                if not self._emit(seq, piece, start, end):
                    return
                seq.mark = self._flushes
                start = monotonic_ns()
        except StopAsyncIteration:
            self._finish(seq, Finish.STOP)
        except asyncio.CancelledError:
            pass  # cancelled by abort, deadline or shutdown: the front knows already
        except Exception as exc:
            self._fail(seq, exc)
        finally:
            self._end(seq)
            close = getattr(iterator, "aclose", None)
            if close is not None:
                try:
                    await close()
                except BaseException as exc:
                    log.warning("request %d: closing the app raised %r", seq.seq_id, exc)

    # --- sync functions: each next() is one job on the executor -------------------------

    def _submit(self, seq: _Seq) -> None:
        executor = self._executor
        assert executor is not None  # sync functions only, and those have one
        seq.busy = True
        try:
            job = executor.submit(self._advance, seq)
        except RuntimeError:  # the executor is shut down: the worker is exiting
            seq.busy = False
            return
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    def _advance(self, seq: _Seq) -> None:
        """Executor thread: run the function to its next piece (or close it if it is done)."""
        iterator = seq.iterator
        if seq.done:
            close = getattr(iterator, "close", None)
            if close is not None:
                try:
                    close()
                except BaseException as exc:
                    log.warning("request %d: closing the app raised %r", seq.seq_id, exc)
            return
        start = time.monotonic_ns()
        try:
            if iterator is None:
                # A sync function: its result is iterable, or iter() fails the request.
                returned = cast("Iterable[object]", self._app(seq.request, seq.context))
                iterator = seq.iterator = iter(returned)
            result: object = next(iterator)
        except StopIteration:
            result = _END
        except BaseException as exc:
            result = _Raised(exc)
        self._completed.append((seq, result, start, time.monotonic_ns()))
        # One wake-up for however many pieces complete before the loop gets to them. The
        # flag is read and written under the GIL; the loop clears it before draining, so a
        # piece appended after the drain began always finds it clear or is drained.
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._take_completed)

    def _take_completed(self) -> None:
        """Loop: handle every piece the executor produced since the last call."""
        self._wake_pending = False
        completed = self._completed
        while completed:
            seq, result, start, end = completed.popleft()
            seq.busy = False
            if seq.done:
                self._submit(seq)  # cancelled while the piece was running: close it
            elif result is _END:
                self._finish(seq, Finish.STOP)
            elif type(result) is _Raised:
                self._fail(seq, result.exc)
            elif self._emit(seq, result, start, end):
                if seq.paused:
                    seq.parked = True  # resume submits the next piece
                else:
                    self._submit(seq)
            else:
                self._submit(seq)  # finished (length, stop token) or a bad piece: close it

    # --- output: one StepOutput per event-loop tick -------------------------------------

    def _emit(self, seq: _Seq, piece: object, start_ns: int, end_ns: int) -> bool:
        """Queue one piece for this tick's message; False once the request has ended.

        This (with `_text_of`, and `stop_in_piece` for the piece's finish) is the only code
        that loops over an app worker's output tokens.
        """
        if seq.done:
            return False
        try:
            tokens = piece_tokens(piece, self._vocab_size, self._encode_piece)
        except (TypeError, ValueError) as exc:
            self._fail(seq, exc)
            return False
        except TokenizerFailed as exc:
            self._fail(
                seq,
                exc.__cause__,
                f"the app's {exc} (on a piece the app yielded); fix the tokenizer",
            )
            return False
        if not tokens:
            return True
        if seq.prompt_len >= 0:
            self._prompt_lens[seq.seq_id] = seq.prompt_len
            seq.prompt_len = -1
        whole = len(tokens)
        sent, reason = stop_in_piece(tokens, seq.generated, seq.max_tokens, seq.stop_token_ids)
        if sent < whole:
            tokens = tokens[:sent]
        if len(tokens) > MAX_OUTPUT_TOKENS:
            self._fail(seq, None, f"the app yielded a piece of {ids_problem(len(tokens))}")
            return False
        detokenize = seq.detokenize
        if detokenize is not None:
            try:
                text = self._text_of(
                    detokenize, piece, tokens, reason != Finish.NONE, len(tokens) < whole
                )
            except Exception as exc:
                self._fail(
                    seq,
                    exc,
                    f"the app's tokenizer.{self._streams_with} raised "
                    f"{type(exc).__name__}: {exc}; fix the tokenizer",
                )
                return False
            problem = text_problem(text)
            if problem is not None:  # no message could carry it, or too large for one
                self._fail(seq, None, f"the app's tokenizer.{self._streams_with} gave {problem}")
                return False
            self._texts.append(text)
        seq.generated += len(tokens)
        self._seq_ids.append(seq.seq_id)
        if len(tokens) == 1:
            self._token_ids.append(tokens[0])
        else:
            self._token_ids.extend(tokens)
            self._several = True
        self._counts.append(len(tokens))
        self._start_ns = max(self._start_ns, start_ns)
        self._end_ns = max(self._end_ns, end_ns)
        if reason:
            self._finished.append(seq.seq_id)
            self._reasons.append(reason)
            self._end(seq)
        self._schedule_flush()
        return not reason

    @staticmethod
    def _text_of(
        detokenize: Callable[[int, bool], str],
        piece: object,
        tokens: list[int],
        last: bool,
        cut: bool,
    ) -> str:
        """A piece's text, with the function's tokenizer: a `str` piece as yielded (unless
        cut short), else what its tokens add to the sequence's text. Every token goes through
        the sequence's detokenizer, so the text of later pieces merges right."""
        final = len(tokens) - 1 if last else -1
        text = "".join([detokenize(t, i == final) for i, t in enumerate(tokens)])
        return piece if type(piece) is str and not cut else text

    def _finish(self, seq: _Seq, reason: Finish) -> None:
        if not seq.done:
            if seq.prompt_len >= 0:  # the function ended without a piece
                self._prompt_lens[seq.seq_id] = seq.prompt_len
            self._finished.append(seq.seq_id)
            self._reasons.append(reason)
            self._end(seq)
            self._schedule_flush()

    def _fail(self, seq: _Seq, exc: BaseException | None, message: str = "") -> None:
        """End a request with INTERNAL: `message`, else the exception's type and text."""
        if seq.done:
            return
        # Not on the token path: a failure is rare and the traceback is what the user needs.
        message = message or f"{type(exc).__name__}: {exc}"
        log.error("request %d failed: %s", seq.seq_id, message, exc_info=exc)
        self._failures.append(RequestFailed(seq.seq_id, Failure.INTERNAL, message))
        self._end(seq)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send this tick's pieces and finishes as one StepOutput, then any failures.

        The message's start is the latest start of a piece in it and its end the latest
        end, so that received <= scheduled <= step start <= step end holds per request.
        """
        self._flush_scheduled = False
        self._flushes += 1
        if self._seq_ids or self._finished:
            end = self._end_ns or time.monotonic_ns()
            self._steps += 1
            message = StepOutput(
                self._worker,
                self._steps,
                self._start_ns or end,
                end,
                self._seq_ids,
                self._token_ids,
                self._finished,
                self._reasons,
                self._counts if self._several else [],
                self._texts,
                self._prompt_lens,
            )
            self._texts, self._prompt_lens = [], {}
            self._seq_ids, self._token_ids, self._counts = [], [], []
            self._finished, self._reasons = [], []
            self._several = False
            self._start_ns = self._end_ns = 0
            self._send(message)
        if self._failures:
            failures, self._failures = self._failures, []
            for failure in failures:
                self._send(failure)

    # --- shutdown -----------------------------------------------------------------------

    async def close(self) -> bool:
        """Cancel every request and wait up to a grace period for the function to let go.

        Returns True when executor threads are still inside the function (a blocking call
        that does not return); the caller decides whether to exit without them.
        """
        for seq in list(self._seqs.values()):
            self._cancel(seq)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=_CLOSE_GRACE_S)
        if self._executor is None:
            return False
        # Closing jobs already queued still run; nothing new can be submitted.
        self._executor.shutdown(wait=False)
        jobs = [asyncio.wrap_future(job) for job in list(self._jobs)]
        if jobs:
            await asyncio.wait(jobs, timeout=_CLOSE_GRACE_S)
        return any(not job.done() for job in self._jobs)


async def serve_app(app: App, spec: WorkerSpec, *, output_hwm: int = OUTPUT_HWM) -> bool:
    """Run an app worker on the running loop until the front sends Shutdown.

    Returns True when executor threads were still inside the function at the end.
    """
    loop = asyncio.get_running_loop()
    channel = worker_channel(spec, output_hwm)
    runner = AppRunner(
        app,
        worker=spec.index,
        device=spec.device,
        threads=spec.engine.engine_threads,
        send=channel.send,
    )
    stopped = loop.create_future()

    def on_readable() -> None:
        for message in channel.receive(0):
            if type(message) is WorkerInputs:
                runner.apply(message)
            elif type(message) is Shutdown and not stopped.done():
                stopped.set_result(None)

    fd = channel.input_fd
    loop.add_reader(fd, on_readable)
    first = loop.call_soon(on_readable)  # inputs that arrived before the reader was added
    try:
        settle_heap()
        channel.send(WorkerReady(spec.index, os.getpid(), "app", boot_id=boot_id()))
        await stopped
    finally:
        first.cancel()
        loop.remove_reader(fd)
        try:
            stuck = await runner.close()
        finally:
            channel.close()
    return stuck


def run_app_worker(spec: WorkerSpec) -> None:
    """A worker process's life with the app engine: import the function, serve, exit."""
    try:
        app = load_app(spec.engine.app)
    except Exception as exc:
        sys.exit(
            f"cadence worker {spec.index}: cannot load app {spec.engine.app!r}: "
            f"{type(exc).__name__}: {exc}"
        )
    stuck = event_loop.run(serve_app(app, spec))
    if stuck:
        # A thread is blocked inside the user's function; the interpreter would wait for it
        # at exit. The sockets are closed and nothing else is pending: leave now.
        log.warning(
            "worker %d: the app is still running in %s; exiting without it",
            spec.index,
            [t.name for t in threading.enumerate() if t.name.startswith("cadence-app")],
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
