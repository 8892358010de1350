"""Soak test: minutes of mixed good and bad traffic against a real server, with a worker
killed midway; checks that nothing is lost, leaked or left hanging.

    python benchmarks/soak.py [--duration 120] [--rate 50] [--json results/soak.json]

It starts `cadence serve --devices cpu:2 --metrics-port 0` and sends Poisson arrivals of:

  normal             read every chunk
  slow               read with a pause after every chunk, or one long pause (tokens merge)
  cancel_before      cancel before the first token
  cancel_mid         cancel after a random number of tokens
  cancel_after_last  cancel after the final chunk, before the status
  deadline           a deadline shorter than the generation
  malformed          bad arguments, bytes that are not a GenerateRequest, invalid UTF-8,
                     a token the engine refuses: INVALID_ARGUMENT naming what is wrong
  over_limit         max_tokens over --max-tokens-limit, a prompt over --max-prompt-tokens
                     (INVALID_ARGUMENT), a message over --max-message-bytes (RESOURCE_EXHAUSTED)

Halfway through, one worker gets SIGKILL; the server restarts it. Checks:

- every stream's tokens are contiguous (`index`), in order and the same as a reference run of
  the same prompt; every OK stream has exactly max_tokens tokens (tokens lost = 0);
- every failure has the status its kind expects, with a message saying why; UNAVAILABLE only
  for streams in flight on the killed worker, naming it;
- afterwards: cadence_active_streams returns to 0, no worker keeps stepping (no sequence left
  in a batch), exactly --max-concurrent streams can be opened at once (no slot leaked) and one
  more is refused, the killed worker is back and health is SERVING;
- the front's RSS and open file descriptors are flat.

Prints a summary, writes JSON, exits 1 if a check failed. `main(argv)` is also what the test
suite calls, with a short duration.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import statistics
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from cadence.lab.servers.server_process import ServerProcess
from cadence.proto.v1 import inference_pb2 as pb
from cadence.proto.v1 import inference_pb2_grpc as pb_grpc

_METRICS = re.compile(r"\(metrics on (\S+):(\d+)\)")
_PROMPTS = [f"soak {i:02d}: tell me how the stream goes" for i in range(16)]
_REFERENCE_TOKENS = 256
"""Tokens of each prompt's reference run; no soak request asks for more."""
_GENERATE = "/cadence.v1.Inference/Generate"
_KILL_WINDOW_S = (1.0, 5.0)
"""A stream may end with UNAVAILABLE if it started at most 1 s after the kill (the supervisor
notices within 0.2 s) and ended within 5 s of it."""
_RSS_GROWTH_LIMIT = 32 * 2**20
_FD_GROWTH_LIMIT = 16

# Server limits the soak runs with, and the mix of request kinds (relative weights).
MAX_CONCURRENT = 64
MAX_TOKENS_LIMIT = 512
MAX_PROMPT_TOKENS = 256
MAX_MESSAGE_BYTES = 64 * 1024
MIX = {
    "normal": 30,
    "slow": 8,
    "cancel_before": 8,
    "cancel_mid": 10,
    "cancel_after_last": 6,
    "deadline": 10,
    "malformed": 14,
    "over_limit": 14,
}


@dataclass
class Outcome:
    """One request as the client saw it, and what was wrong with it ([] if nothing)."""

    kind: str
    variant: str
    start_s: float
    end_s: float = 0.0
    code: str = ""
    details: str = ""
    max_tokens: int = 0
    tokens: int = 0
    complete: bool = False
    """The final chunk (finish_reason LENGTH) arrived."""
    lost: int = 0
    """Tokens an OK stream was short of max_tokens."""
    problems: list[str] = field(default_factory=list)


@dataclass
class Spec:
    """One request to send: a message (or raw bytes) and how the client behaves."""

    kind: str
    variant: str
    prompt: int = 0
    request: pb.GenerateRequest | None = None
    raw: bytes | None = None
    timeout_s: float | None = None
    cancel_after_s: float | None = None
    cancel_at_tokens: int | None = None
    read_delay_s: float = 0.0
    pause_s: float = 0.0
    expect: tuple[str, str] | None = None
    """Refused requests: (status code, text the message must contain)."""


def draw(rng: random.Random) -> Spec:
    """A random request of a random kind, in the proportions of MIX."""
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    p = rng.randrange(len(_PROMPTS))

    def request(max_tokens: int, **fields) -> pb.GenerateRequest:
        fields.setdefault("prompt", _PROMPTS[p])
        return pb.GenerateRequest(max_tokens=max_tokens, **fields)

    if kind == "normal":
        return Spec(kind, "read all", p, request(rng.randint(1, 64)))
    if kind == "slow":
        if rng.random() < 0.5:
            return Spec(
                kind,
                "pause per chunk",
                p,
                request(rng.randint(16, 96)),
                read_delay_s=rng.uniform(0.01, 0.04),
            )
        return Spec(
            kind, "one long pause", p, request(rng.randint(32, 128)), pause_s=rng.uniform(0.5, 1.5)
        )
    if kind == "cancel_before":
        return Spec(
            kind, "before first token", p, request(64), cancel_after_s=rng.uniform(0.0, 0.004)
        )
    if kind == "cancel_mid":
        max_tokens = rng.randint(32, 160)
        return Spec(
            kind,
            "mid-stream",
            p,
            request(max_tokens),
            cancel_at_tokens=rng.randint(1, max_tokens - 1),
        )
    if kind == "cancel_after_last":
        return Spec(kind, "after last chunk", p, request(rng.randint(1, 48)))
    if kind == "deadline":
        return Spec(
            kind, "deadline", p, request(_REFERENCE_TOKENS), timeout_s=rng.uniform(0.02, 0.6)
        )
    invalid = "INVALID_ARGUMENT"
    if kind == "malformed":
        variant = rng.choice(
            [
                "max_tokens 0",
                "empty prompt",
                "negative temperature",
                "top_p above 1",
                "negative token id",
                "token the engine refuses",
                "not a GenerateRequest",
                "invalid UTF-8",
            ]
        )
        if variant == "not a GenerateRequest":
            # Field 1 (request_id) claims 2**28 bytes and the message ends: truncated.
            return Spec(kind, variant, raw=b"\x0a\x80\x80\x80\x80\x01abc", expect=(invalid, ""))
        if variant == "invalid UTF-8":
            # Field 2 (prompt, a proto3 string) holding the bytes C3 28: not UTF-8.
            return Spec(kind, variant, raw=b"\x12\x02\xc3\x28\x18\x04", expect=(invalid, ""))
        built = {
            "max_tokens 0": (request(0), "max_tokens"),
            "empty prompt": (request(8, prompt=""), "prompt"),
            "negative temperature": (
                request(8, sampling=pb.SamplingParams(temperature=-1)),
                "temperature",
            ),
            "top_p above 1": (request(8, sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
            "negative token id": (
                request(8, prompt="", prompt_token_ids=[5, -3]),
                "prompt_token_ids",
            ),
            "token the engine refuses": (
                request(8, prompt="", prompt_token_ids=[65, 4096]),
                "prompt_token_ids",
            ),
        }[variant]
        return Spec(kind, variant, request=built[0], expect=(invalid, built[1]))
    variant = rng.choice(
        ["max_tokens over the limit", "prompt over the limit", "message over the limit"]
    )
    if variant == "max_tokens over the limit":
        return Spec(
            kind,
            variant,
            request=request(rng.randint(MAX_TOKENS_LIMIT + 1, 10**6)),
            expect=(invalid, "--max-tokens-limit"),
        )
    if variant == "prompt over the limit":
        return Spec(
            kind,
            variant,
            request=request(8, prompt="x" * rng.randint(MAX_PROMPT_TOKENS + 1, 4000)),
            expect=(invalid, "--max-prompt-tokens"),
        )
    return Spec(
        kind,
        variant,
        request=request(8, prompt="y" * (MAX_MESSAGE_BYTES + 100)),
        expect=("RESOURCE_EXHAUSTED", "larger than max"),
    )


class Soak:
    """Runs the traffic, the fault and the checks against one server."""

    def __init__(
        self, server: ServerProcess, metrics_url: str, options: argparse.Namespace
    ) -> None:
        self.server = server
        self.front = psutil.Process(server.pid)
        self.metrics_url = metrics_url
        self.options = options
        self.rng = random.Random(options.seed)
        self.outcomes: list[Outcome] = []
        self.reference: list[list[int]] = []
        self.kill: dict = {}
        self.samples: list[dict] = []
        self.traffic_end_s = 0.0
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- traffic ------------------------------------------------------------------------------

    async def run(self) -> dict:
        target = self.server.target
        channels = [grpc.aio.insecure_channel(target) for _ in range(2)]
        stubs = [pb_grpc.InferenceStub(c) for c in channels]
        raw_calls = [
            c.unary_stream(
                _GENERATE,
                request_serializer=None,
                response_deserializer=pb.GenerateChunk.FromString,
            )
            for c in channels
        ]
        health = health_pb2_grpc.HealthStub(channels[0])
        try:
            await self._fetch_reference(stubs[0])
            sampler = asyncio.ensure_future(self._sample_front())
            await asyncio.sleep(0.3)  # a first RSS sample before traffic
            killer = asyncio.ensure_future(self._kill_a_worker(health))
            tasks: list[asyncio.Task] = []
            duration = self.options.duration
            start = time.monotonic()
            t = 0.0
            n = 0
            while True:
                t += self.rng.expovariate(self.options.rate)
                if t > duration:
                    break
                delay = start + t - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)  # when late, send now rather than skip
                spec = draw(self.rng)
                tasks.append(asyncio.ensure_future(self._one(spec, stubs[n % 2], raw_calls[n % 2])))
                n += 1
            self.outcomes = list(await asyncio.gather(*tasks))
            self.traffic_end_s = self.now()
            await killer
            after = await self._after_the_run(stubs[0], health)
            sampler.cancel()
            return after
        finally:
            for channel in channels:
                await channel.close()

    async def _fetch_reference(self, stub: pb_grpc.InferenceStub) -> None:
        """Each prompt's first _REFERENCE_TOKENS tokens, before any fault."""

        async def one(prompt: str) -> list[int]:
            tokens: list[int] = []
            async for chunk in stub.Generate(
                pb.GenerateRequest(prompt=prompt, max_tokens=_REFERENCE_TOKENS), timeout=60
            ):
                tokens.extend(chunk.token_ids)
            assert len(tokens) == _REFERENCE_TOKENS, "the reference run was cut short"
            return tokens

        self.reference = list(await asyncio.gather(*(one(p) for p in _PROMPTS)))

    async def _one(self, spec: Spec, stub: pb_grpc.InferenceStub, raw_call) -> Outcome:
        """Send one request, behave as its kind says, and check what came back. Never raises."""
        max_tokens = spec.request.max_tokens if spec.request is not None else 0
        out = Outcome(spec.kind, spec.variant, self.now(), max_tokens=max_tokens)
        if spec.raw is not None:
            call = raw_call(spec.raw, timeout=spec.timeout_s or 30)
        else:
            call = stub.Generate(spec.request, timeout=spec.timeout_s or 30)
        tokens: list[int] = []
        try:
            if spec.cancel_after_s is not None:
                await asyncio.sleep(spec.cancel_after_s)
                call.cancel()
            else:
                async for chunk in call:
                    self._check_chunk(spec, chunk, tokens, out)
                    if chunk.finish_reason:
                        out.complete = True
                        if spec.kind == "cancel_after_last":
                            call.cancel()  # the final chunk is in; its status is not yet
                            break
                    elif spec.cancel_at_tokens is not None and len(tokens) >= spec.cancel_at_tokens:
                        call.cancel()
                        break
                    if spec.pause_s and chunk.index == 0:
                        await asyncio.sleep(spec.pause_s)
                    elif spec.read_delay_s:
                        await asyncio.sleep(spec.read_delay_s)
            code = await call.code()
            out.code, out.details = code.name, await call.details() or ""
        except grpc.aio.AioRpcError as exc:
            out.code, out.details = exc.code().name, exc.details() or ""
        except asyncio.CancelledError:
            out.code = "CANCELLED"
        except Exception as exc:
            out.code, out.details = "CLIENT_ERROR", repr(exc)
        out.end_s = self.now()
        out.tokens = len(tokens)
        self._check_outcome(spec, out)
        return out

    def _check_chunk(
        self, spec: Spec, chunk: pb.GenerateChunk, tokens: list[int], out: Outcome
    ) -> None:
        if chunk.index != len(tokens):
            out.problems.append(f"chunk index {chunk.index} after {len(tokens)} tokens")
        expected = self.reference[spec.prompt][len(tokens) : len(tokens) + len(chunk.token_ids)]
        if list(chunk.token_ids) != expected:
            out.problems.append(
                f"tokens {len(tokens)}..: {list(chunk.token_ids)[:8]} "
                f"differ from the reference {expected[:8]}"
            )
        if out.complete:
            out.problems.append("a chunk after the final one")
        tokens.extend(chunk.token_ids)
        if chunk.finish_reason and chunk.finish_reason != pb.FINISH_REASON_LENGTH:
            out.problems.append(f"finish_reason {chunk.finish_reason}, expected LENGTH")

    def _check_outcome(self, spec: Spec, out: Outcome) -> None:
        """Is this status what the request's kind should get, with a clear message?"""
        if out.complete and out.tokens != out.max_tokens:
            out.problems.append(f"final chunk after {out.tokens} of {out.max_tokens} tokens")
        if out.code == "OK":
            out.lost = max(out.max_tokens - out.tokens, 0)
            if not out.complete:
                out.problems.append("OK without a final chunk")
        if out.code == "UNAVAILABLE" and self._killed_under(out):
            return  # its worker was killed before it could answer (a request the engine refuses)
        if spec.expect is not None:
            code, needle = spec.expect
            if out.code != code or needle not in out.details or not out.details:
                out.problems.append(
                    f"expected {code} mentioning {needle!r}, got {out.code}: {out.details!r}"
                )
            return
        allowed = {
            "normal": {"OK"},
            "slow": {"OK"},
            "cancel_before": {"CANCELLED"},
            "cancel_mid": {"CANCELLED"} | ({"OK"} if out.complete else set()),
            "cancel_after_last": {"OK", "CANCELLED"},
            "deadline": {"DEADLINE_EXCEEDED"},
        }[spec.kind]
        if out.code in allowed:
            if spec.kind == "cancel_after_last" and not out.complete:
                out.problems.append("cancelled after the last chunk, but it never came")
            return
        if out.code == "UNAVAILABLE" and self._killed_under(out):
            return
        if out.code == "RESOURCE_EXHAUSTED" and "--max-concurrent" in out.details:
            return  # admission refused it at once, with the reason: expected under a burst
        out.problems.append(f"{spec.kind}: unexpected {out.code}: {out.details!r}")

    def _killed_under(self, out: Outcome) -> bool:
        """Was this stream in flight on the killed worker, and does the message say so?"""
        at = self.kill.get("killed_at_s")
        if at is None:
            return False
        before, after = _KILL_WINDOW_S
        named = f"worker {self.kill['worker']}" in out.details
        return named and out.start_s <= at + before and at <= out.end_s <= at + after

    # --- the fault ----------------------------------------------------------------------------

    def _workers(self) -> dict[int, psutil.Process]:
        """{worker index: process}, read from each worker's command line (its spec JSON)."""
        found = {}
        for child in self.front.children():
            try:
                match = re.search(r'"index":\s*(\d+)', " ".join(child.cmdline()))
            except psutil.Error:
                continue
            if match:
                found[int(match.group(1))] = child
        return found

    async def _kill_a_worker(self, health: health_pb2_grpc.HealthStub) -> None:
        """SIGKILL one worker halfway; record how long until it is back and what health said."""
        await asyncio.sleep(self.options.duration * self.options.kill_at)
        workers = self._workers()
        index = self.rng.choice(sorted(workers))
        victim = workers[index]
        self.kill = {"worker": index, "pid": victim.pid, "killed_at_s": self.now()}
        victim.send_signal(signal.SIGKILL)
        service = f"cadence.worker.{index}"
        seen: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            if not seen or seen[-1] != status:
                seen.append(status)
            replacement = self._workers().get(index)
            if status == "SERVING" and "NOT_SERVING" in seen and replacement is not None:
                self.kill.update(
                    new_pid=replacement.pid,
                    back_after_s=round(self.now() - self.kill["killed_at_s"], 3),
                )
                break
            await asyncio.sleep(0.05)
        self.kill["health_seen"] = seen

    # --- measurements -------------------------------------------------------------------------

    async def _sample_front(self) -> None:
        while True:
            try:
                with self.front.oneshot():
                    self.samples.append(
                        {
                            "t_s": round(self.now(), 2),
                            "rss": self.front.memory_info().rss,
                            "fds": self.front.num_fds(),
                            "threads": self.front.num_threads(),
                        }
                    )
            except psutil.Error:
                return
            await asyncio.sleep(0.5)

    async def _scrape(self) -> dict[str, float]:
        def get() -> str:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as reply:
                return reply.read().decode()

        values = {}
        for family in text_string_to_metric_families(await asyncio.to_thread(get)):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values

    async def _until_idle(self, timeout_s: float = 10.0) -> tuple[float, float]:
        """Wait for cadence_active_streams to read 0; (its last value, seconds waited)."""
        start = time.monotonic()
        while True:
            active = (await self._scrape())["cadence_active_streams"]
            if active == 0 or time.monotonic() - start > timeout_s:
                return active, round(time.monotonic() - start, 3)
            await asyncio.sleep(0.05)

    async def _after_the_run(
        self, stub: pb_grpc.InferenceStub, health: health_pb2_grpc.HealthStub
    ) -> dict:
        """Leak checks once the traffic has stopped."""
        active, waited = await self._until_idle()
        steps = {
            k: v
            for k, v in (await self._scrape()).items()
            if k.startswith("cadence_worker_steps_total")
        }
        await asyncio.sleep(0.5)
        later = {k: v for k, v in (await self._scrape()).items() if k in steps}
        still_stepping = {k: later[k] - steps[k] for k in steps if later.get(k, 0) != steps[k]}
        slots = await self._slot_check(stub)
        active_after_slots, _ = await self._until_idle()
        metrics = await self._scrape()
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return {
            "active_streams_after_run": active,
            "seconds_to_zero_active": waited,
            "workers_still_stepping_when_idle": still_stepping,
            "slot_check": slots,
            "active_streams_at_end": active_after_slots,
            "deepest_buffer_steps_at_end": metrics.get("cadence_deepest_buffer_steps"),
            "server_requests_by_code": _by_code(metrics),
            "health_at_end": health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status),
            "workers_at_end": len(self._workers()),
        }

    async def _slot_check(self, stub: pb_grpc.InferenceStub) -> dict:
        """Exactly --max-concurrent streams can be open at once: none was leaked."""
        calls = [
            stub.Generate(
                pb.GenerateRequest(prompt=_PROMPTS[i % len(_PROMPTS)], max_tokens=MAX_TOKENS_LIMIT),
                timeout=30,
            )
            for i in range(MAX_CONCURRENT)
        ]
        opened = 0
        for call in calls:
            try:
                if await call.read() is not grpc.aio.EOF:
                    opened += 1
            except grpc.aio.AioRpcError:
                pass
        extra = stub.Generate(pb.GenerateRequest(prompt="one too many", max_tokens=8), timeout=10)
        try:
            await extra.read()
            extra_code = "OK"
        except grpc.aio.AioRpcError as exc:
            extra_code = exc.code().name
        for call in calls:
            call.cancel()
        return {"limit": MAX_CONCURRENT, "opened": opened, "one_more": extra_code}


def _by_code(metrics: dict[str, float]) -> dict[str, int]:
    """`cadence_requests_total` by code, summed over its other labels (protocol, front): the
    soak's question is how requests ended, whichever API they came through."""
    out: dict[str, int] = {}
    for key, value in metrics.items():
        if key.startswith("cadence_requests_total{"):
            labels = dict(part.split("=", 1) for part in key[key.index("{") + 1 : -1].split(","))
            out[labels["code"]] = out.get(labels["code"], 0) + int(value)
    return out


def summarize(soak: Soak, after: dict, options: argparse.Namespace) -> dict:
    """The figures and the verdict of each check."""
    outcomes = soak.outcomes
    by_kind: dict[str, Counter] = {}
    for out in outcomes:
        by_kind.setdefault(out.kind, Counter())[out.code] += 1
    problems = [
        f"{o.kind} ({o.variant}) at {o.start_s:.2f} s: {p}" for o in outcomes for p in o.problems
    ]
    samples = soak.samples
    rss = [s["rss"] for s in samples]
    fds = [s["fds"] for s in samples]
    mib = 2**20
    memory = {
        "rss_start_mib": round(rss[0] / mib, 1),
        "rss_end_mib": round(rss[-1] / mib, 1),
        "rss_max_mib": round(max(rss) / mib, 1),
        "rss_median_mib": round(statistics.median(rss) / mib, 1),
        "rss_end_of_traffic_mib": round(
            [s["rss"] for s in samples if s["t_s"] <= soak.traffic_end_s][-1] / mib, 1
        ),
        "fds_start": fds[0],
        "fds_end": fds[-1],
        "fds_max": max(fds),
        "threads_start": samples[0]["threads"],
        "threads_end": samples[-1]["threads"],
        "samples": len(rss),
    }
    slots = after["slot_check"]
    checks = {
        "streams_whole_and_in_order": not problems,
        "tokens_lost_zero": sum(o.lost for o in outcomes) == 0,
        "active_streams_back_to_zero": after["active_streams_after_run"] == 0
        and after["active_streams_at_end"] == 0,
        "no_sequence_left_in_a_worker": not after["workers_still_stepping_when_idle"],
        "no_slot_leaked": slots["opened"] == slots["limit"]
        and slots["one_more"] == "RESOURCE_EXHAUSTED",
        "killed_worker_restarted": "back_after_s" in soak.kill
        and after["workers_at_end"] == 2
        and after["health_at_end"] == "SERVING",
        "rss_flat": rss[-1] - rss[0] <= _RSS_GROWTH_LIMIT,
        "fds_flat": fds[-1] - fds[0] <= _FD_GROWTH_LIMIT,
    }
    return {
        "passed": all(checks.values()),
        "checks": checks,
        "duration_s": options.duration,
        "rate_per_s": options.rate,
        "requests": len(outcomes),
        "requests_by_kind": {k: sum(c.values()) for k, c in sorted(by_kind.items())},
        "errors_by_code": dict(sorted(Counter(o.code for o in outcomes if o.code != "OK").items())),
        "codes_by_kind": {k: dict(sorted(c.items())) for k, c in sorted(by_kind.items())},
        "faults": {
            "worker_kills": 1 if soak.kill else 0,
            "cancelled_by_client": sum(o.kind.startswith("cancel") for o in outcomes),
            "deadlines": by_kind.get("deadline", Counter()).total(),
            "malformed": by_kind.get("malformed", Counter()).total(),
            "over_limit": by_kind.get("over_limit", Counter()).total(),
            "slow_readers": by_kind.get("slow", Counter()).total(),
            "streams_ended_by_the_kill": sum(o.code == "UNAVAILABLE" for o in outcomes),
        },
        "tokens_delivered": sum(o.tokens for o in outcomes),
        "tokens_lost": sum(o.lost for o in outcomes),
        "completed_streams": sum(o.complete for o in outcomes),
        "kill": soak.kill,
        "front": memory,
        "after": after,
        "problems": problems[:50],
        "problem_count": len(problems),
        "server_args": soak.server.args,
        "rss_samples": [(s["t_s"], round(s["rss"] / mib, 2)) for s in samples],
    }


def print_summary(result: dict) -> None:
    front, kill, after = result["front"], result["kill"], result["after"]
    print(
        f"soak: {result['requests']} requests in {result['duration_s']:.0f} s "
        f"({result['rate_per_s']:g}/s): {result['requests_by_kind']}"
    )
    print(f"  faults: {result['faults']}")
    print(f"  errors by code: {result['errors_by_code']}")
    print(
        f"  completed streams {result['completed_streams']}, tokens delivered "
        f"{result['tokens_delivered']}, tokens lost {result['tokens_lost']}"
    )
    print(
        f"  worker {kill.get('worker')} killed at {kill.get('killed_at_s', 0):.1f} s, back after "
        f"{kill.get('back_after_s')} s; health seen {kill.get('health_seen')}"
    )
    print(
        f"  front RSS start {front['rss_start_mib']} MiB, end of traffic "
        f"{front['rss_end_of_traffic_mib']} MiB, end {front['rss_end_mib']} MiB, max "
        f"{front['rss_max_mib']} MiB; fds {front['fds_start']} -> {front['fds_end']}"
    )
    print(
        f"  after: active streams {after['active_streams_after_run']} "
        f"(in {after['seconds_to_zero_active']} s), slots {after['slot_check']}, "
        f"still stepping {after['workers_still_stepping_when_idle'] or 'none'}"
    )
    for name, ok in result["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    for problem in result["problems"][:10]:
        print(f"  problem: {problem}")
    print("PASSED" if result["passed"] else "FAILED")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of traffic")
    p.add_argument("--rate", type=float, default=50.0, help="requests per second (Poisson)")
    p.add_argument("--step-ms", type=float, default=5.0, help="the synthetic engine's step")
    p.add_argument(
        "--kill-at",
        type=float,
        default=0.5,
        help="when to kill a worker, as a fraction of --duration",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/soak.json", help="where to write the result")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 if every check passed, else 1."""
    options = parse_args(argv)
    server = ServerProcess(
        "--devices",
        "cpu:2",
        "--metrics-port",
        "0",
        "--step-ms",
        str(options.step_ms),
        "--max-concurrent",
        str(MAX_CONCURRENT),
        "--max-tokens-limit",
        str(MAX_TOKENS_LIMIT),
        "--max-prompt-tokens",
        str(MAX_PROMPT_TOKENS),
        "--max-message-bytes",
        str(MAX_MESSAGE_BYTES),
    )
    with server:
        match = _METRICS.search(server.banner)
        if match is None:
            raise RuntimeError(f"no metrics endpoint in the banner: {server.banner!r}")
        soak = Soak(server, f"http://{match.group(1)}:{match.group(2)}/metrics", options)
        after = asyncio.run(soak.run())
        result = summarize(soak, after, options)
    result["server_exit_status"] = server.process.returncode
    print_summary(result)
    if options.json:
        path = Path(options.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
