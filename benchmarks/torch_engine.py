"""Throughput and latency of the torch engine, against transformers on the same model and prompts.

    python benchmarks/torch_engine.py [--sizes tiny,100m] [--batches 1,8,32] [--tp 1,2]
        [--prompt 32] [--tokens 32] [--concurrent 32] [--out results/torch_engine.json]

Every model is a random LlamaForCausalLM written by transformers to a temporary folder, so
cadence and transformers load the very same weights:
  tiny  the shape of `--model tiny` (about 1M parameters, byte vocabulary);
  100m  hidden 768, 12 layers, 12 heads, 4 KV heads, MLP 2048, vocab 32000, tied (100.1M).

Parts, per size:
  A  engine only: a BatchScheduler over LlamaEngine, `batch` prompts admitted together, each
     generating `--tokens` tokens: tokens/s (prefill included) and mean decode step time, at
     TP 1 (one process, every core) and TP 2 (two gloo ranks, two processes, half the cores each).
  B  `--concurrent` requests at once: `cadence serve` (continuous batching, streamed over gRPC
     to an asyncio client in this process) vs transformers `generate` serving them one at a
     time, and vs one padded `generate` call for all of them. Targets: cadence >= 3x.
  C  one stream: cadence's served inter-token latency (client side) and engine decode step vs
     transformers' per-token time ((generate N - generate 1) / (N - 1)). Target: <= 1.1x.
Greedy decoding everywhere; cadence's served tokens are checked against transformers'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "100m": {
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
}
CORES = os.cpu_count() or 1


def make_model(size: str, folder: Path) -> Path:
    """Save a random transformers model of the given shape (no EOS: every request runs to length)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **SHAPES[size],
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return folder


def prompts(count: int, length: int, vocab: int, vary: bool) -> list[list[int]]:
    """Deterministic prompts; with `vary`, lengths spread over [length/2, 3*length/2]."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        n = length // 2 + (i * length) // max(count - 1, 1) if vary and count > 1 else length
        out.append(torch.randint(2, vocab, (max(n, 1),), generator=gen).tolist())
    return out


# -- A: engine steps ------------------------------------------------------------------------


def engine_runs(
    folder: str,
    batches: list[int],
    prompt: int,
    tokens: int,
    *,
    rank: int = 0,
    size: int = 1,
    init: str = "",
) -> list[dict] | None:
    """Rank 0: one measurement per batch size. Other ranks follow and return None."""
    from cadence.config import EngineConfig
    from cadence.engines.llama.engine import LlamaEngine
    from cadence.vocabulary import AddRequest
    from cadence.worker.batch_scheduler import BatchScheduler

    config = EngineConfig(
        name="torch", model=folder, kv_cache_tokens=65536, threads=max(1, CORES // size)
    )
    engine = LlamaEngine(config, "cpu", rank=rank, group_size=size, dist_init=init)
    if rank > 0:
        engine.follow()
        return None
    engine.start()
    vocab = engine.vocab_size
    results = []
    for batch in batches:
        scheduler = BatchScheduler(engine, 0, 1024)
        for i, p in enumerate(prompts(batch, prompt, vocab, vary=True)):
            scheduler.add(AddRequest(i, p, tokens))
        steps = []
        start = time.perf_counter()
        while scheduler.has_work:
            out = scheduler.step()
            steps.append((out.end_ns - out.start_ns) / 1e6)
        wall = time.perf_counter() - start
        results.append(
            {
                "batch": batch,
                "tp": size,
                "tokens_per_s": batch * tokens / wall,
                "prefill_step_ms": steps[0],
                "decode_step_ms": statistics.mean(steps[1:]),
            }
        )
    engine.close()
    return results


def engine_runs_tp(
    folder: str, batches: list[int], prompt: int, tokens: int, size: int
) -> list[dict]:
    """The same measurement with `size` ranks, each in its own process."""
    with tempfile.TemporaryDirectory(prefix="cadence-bench-tp-") as store:
        common = [
            folder,
            json.dumps(batches),
            str(prompt),
            str(tokens),
            str(size),
            f"file://{store}/s",
        ]
        ranks = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank", str(r), *common],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(size)
        ]
        outs = [p.communicate()[0] for p in ranks]
    if any(p.returncode for p in ranks):
        raise RuntimeError(f"a TP rank failed: {[p.returncode for p in ranks]}")
    return json.loads(outs[0])


# -- B and C: served by cadence vs transformers generate -------------------------------------


async def _stream_all(target: str, batch: list[list[int]], tokens: int) -> tuple[float, list, list]:
    from cadence.client import AsyncClient

    async with AsyncClient(target) as client:

        async def one(p: list[int]) -> tuple[list[int], list[float]]:
            got, arrivals = [], []
            async for chunk in client.generate(p, max_tokens=tokens):
                got.extend(chunk.token_ids)
                arrivals.extend([time.perf_counter()] * len(chunk.token_ids))
            return got, arrivals

        await one(batch[0][:4])  # connection and first-step warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in batch))
        wall = time.perf_counter() - start
    return wall, [r[0] for r in results], [r[1] for r in results]


def served(folder: str, batch: list[list[int]], tokens: int) -> tuple[float, list, list]:
    from cadence.lab.servers.server_process import ServerProcess

    with ServerProcess(
        "--model",
        folder,
        "--kv-cache-tokens",
        "65536",
        "--max-batch",
        "256",
        "--startup-timeout",
        "300",
    ) as server:
        return asyncio.run(_stream_all(server.target, batch, tokens))


class Transformers:
    """transformers' generate on the same folder, greedy, every request to its full length."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(CORES)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()

    def generate(self, batch: list[list[int]], tokens: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        # Left padding, as decoder-only generation needs.
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, width:].tolist()

    def timed(self, batch: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        out = self.generate(batch, tokens)
        return time.perf_counter() - start, out


def compare(folder: str, args: argparse.Namespace, vocab: int, engine_b1_step_ms: float) -> dict:
    hf = Transformers(folder)
    batch = prompts(args.concurrent, args.prompt, vocab, vary=True)
    hf.generate(batch[:1], 2)  # warm-up
    # B: concurrent requests.
    c_wall, c_tokens, _ = served(folder, batch, args.tokens)
    seq_wall = 0.0
    seq_tokens = []
    for p in batch:
        wall, out = hf.timed([p], args.tokens)
        seq_wall += wall
        seq_tokens.append(out[0])
    pad_wall, _ = hf.timed(batch, args.tokens)
    total = args.concurrent * args.tokens
    part_b = {
        "concurrent": args.concurrent,
        "cadence_served_tokens_per_s": total / c_wall,
        "transformers_one_at_a_time_tokens_per_s": total / seq_wall,
        "transformers_padded_batch_tokens_per_s": total / pad_wall,
        "speedup_vs_one_at_a_time": seq_wall / c_wall,
        "speedup_vs_padded_batch": pad_wall / c_wall,
        "greedy_tokens_equal": c_tokens == seq_tokens,
    }
    # C: one stream.
    single = prompts(1, args.prompt, vocab, vary=False)
    _, _, arrivals = served(folder, single, args.tokens)
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals[0], arrivals[0][1:])]
    t1 = min(hf.timed(single, 1)[0] for _ in range(3))
    tn = min(hf.timed(single, args.tokens)[0] for _ in range(2))
    hf_per_token = (tn - t1) / (args.tokens - 1) * 1e3
    part_c = {
        "cadence_served_itl_mean_ms": statistics.mean(gaps),
        "cadence_served_itl_p50_ms": statistics.median(gaps),
        "cadence_engine_decode_step_ms": engine_b1_step_ms,
        "transformers_per_token_ms": hf_per_token,
        "served_itl_ratio": statistics.mean(gaps) / hf_per_token,
        "engine_step_ratio": engine_b1_step_ms / hf_per_token,
    }
    return {"concurrent": part_b, "single_stream": part_c}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="tiny,100m")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--tp", default="1,2")
    p.add_argument(
        "--prompt", type=int, default=32, help="prompt length (parts A, B: spread 0.5-1.5x)"
    )
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--concurrent", type=int, default=32)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("rank_args", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:  # one rank of a TP measurement (started by engine_runs_tp)
        folder, batches, prompt, tokens, size, init = args.rank_args
        out = engine_runs(
            folder,
            json.loads(batches),
            int(prompt),
            int(tokens),
            rank=args.rank,
            size=int(size),
            init=init,
        )
        if out is not None:
            print(json.dumps(out))
        return

    batches = [int(b) for b in args.batches.split(",")]
    report = {
        "host": {
            "cores": CORES,
            "machine": platform.machine(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "prompt": args.prompt,
        "tokens": args.tokens,
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="cadence-bench-") as tmp:
        for size in args.sizes.split(","):
            folder = str(make_model(size, Path(tmp) / size))
            runs = []
            for tp in (int(t) for t in args.tp.split(",")):
                torch.set_num_threads(CORES)
                if tp == 1:
                    runs += engine_runs(folder, batches, args.prompt, args.tokens)
                else:
                    runs += engine_runs_tp(folder, batches, args.prompt, args.tokens, tp)
                for r in runs[-len(batches) :]:
                    print(
                        f"{size:>5} A tp={r['tp']} batch={r['batch']:>3}: {r['tokens_per_s']:8.1f} tok/s, "
                        f"decode step {r['decode_step_ms']:7.2f} ms, prefill step "
                        f"{r['prefill_step_ms']:7.1f} ms",
                        flush=True,
                    )
            b1 = next((r["decode_step_ms"] for r in runs if r["tp"] == 1 and r["batch"] == 1), 0.0)
            cmp_ = compare(folder, args, SHAPES[size]["vocab_size"], b1)
            print(f"{size:>5} B {json.dumps(cmp_['concurrent'])}", flush=True)
            print(f"{size:>5} C {json.dumps(cmp_['single_stream'])}", flush=True)
            report["sizes"][size] = {"engine": runs, **cmp_}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
