"""One prepared check of the torch engine's GPU paths, for a lent CUDA machine (docs/torch-engine.md,
"GPU check"). Writes $OUT/gpu_check.json (or --out DIR) after every stage, so a stage that fails
or a run cut short keeps what the others found.

    python benchmarks/gpu_check.py                       # on the GPU machine: cuda:0, full check
    python benchmarks/gpu_check.py --device cpu --quick  # smoke test of this script, any machine

Stages (each guarded: its error is recorded and the next one runs; one summary line each):
  env       torch.__version__, torch.cuda.is_available(), the card; stops the run, with the reason,
            when --device cuda:N is asked for and torch sees no such card, or cadence's engine
            cannot be imported (names the missing module; gpu_check.sh installs carried wheels).
  engine    LlamaEngine on --device, float32: greedy tokens equal transformers' greedy tokens
            (CPU, float32, as the tests do) for mixed-length prompts alone, admitted together,
            and joining one per step.
  bf16      the same prompts in bfloat16, cadence vs transformers both on --device in bfloat16:
            agreement only (rounding differs, so greedy paths may part); not pass/fail.
  served    `cadence serve --engine torch --model DIR --devices cuda:N` and a cadence client:
            text and token-id prompts, concurrently, equal transformers' greedy tokens.
  tp        with two or more cards: two NCCL ranks (LlamaEngine, one process per rank) and
            `cadence serve --devices cuda:0,1 --tp 2`, both against transformers; with one card
            "skipped: 1 card". With --device cpu: two gloo ranks (this script's own smoke test).
  perf      tokens/s and decode step time of LlamaEngine on --device for the sizes of
            benchmarks/torch_engine.py (tiny, 100m) at batch 1, 8, 32, in float32 and bfloat16,
            plus transformers' per-token time at batch 1 on the same device and dtype.
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
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The working tree's cadence (src/), the tests' model helpers (tests/) and torch_engine.py's.
for _p in (ROOT / "benchmarks", ROOT, ROOT / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
# Servers and TP ranks are child processes: they must import the same cadence.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT / "src"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
)

T0 = time.monotonic()


def elapsed() -> float:
    return time.monotonic() - T0


# -- the report ------------------------------------------------------------------------------


class Report:
    """The JSON result, rewritten after each stage."""

    def __init__(self, out_dir: Path, argv: list[str]) -> None:
        self.path = out_dir / "gpu_check.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        self.data: dict = {
            "argv": argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "stages": {},
        }
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(elapsed(), 1)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def stage(self, name: str, fn, *args) -> dict:
        """Run one stage; its dict must hold `status` and `summary`; an exception is recorded."""
        start = time.monotonic()
        try:
            result = fn(*args)
        except Exception as exc:
            result = {
                "status": "error",
                "summary": f"{type(exc).__name__}: {exc}"[:400],
                "traceback": traceback.format_exc()[-4000:],
            }
        result["seconds"] = round(time.monotonic() - start, 1)
        self.data["stages"][name] = result
        self.write()
        print(
            f"[{name}] {result['status'].upper()} ({result['seconds']} s): {result['summary']}",
            flush=True,
        )
        return result


def free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- env ------------------------------------------------------------------------------------


def stage_env(args: argparse.Namespace) -> dict:
    info: dict = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch
    except ImportError as exc:
        return {"status": "stop", "summary": f"stopped: torch is not importable ({exc})", **info}
    info["torch"] = torch.__version__
    info["torch_cuda_build"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    info["cuda_device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
    print(f"torch.__version__ = {torch.__version__} (CUDA build {torch.version.cuda})", flush=True)
    print(f"torch.cuda.is_available() = {info['cuda_available']}", flush=True)
    if info["cuda_available"]:
        info["devices"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(info["cuda_device_count"])
        ]
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:
            info["nccl"] = f"unknown ({exc})"
        print(f"device name = {', '.join(d['name'] for d in info['devices'])}", flush=True)
    else:
        print("device name = (no CUDA card visible to torch)", flush=True)
    info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32

    missing = {}
    for module in (
        "transformers",
        "safetensors",
        "tokenizers",
        "msgspec",
        "zmq",
        "grpc",
        "grpc_health.v1",
        "grpc_reflection.v1alpha",
        "google.protobuf",
        "psutil",
        "prometheus_client",
        "cadence.engines.llama.engine",
        "cadence.worker.batch_scheduler",
        "cadence.client",
        "cadence.cli",
        "cadence.serving",
        "cadence.lifecycle.server",
    ):
        try:
            mod = __import__(module, fromlist=["_"])
            if module in ("transformers", "grpc", "google.protobuf"):
                info[f"{module}_version"] = getattr(mod, "__version__", "?")
        except Exception as exc:
            missing[module] = f"{type(exc).__name__}: {exc}"[:200]
    info["import_failures"] = missing
    engine_missing = [
        m
        for m in missing
        if m
        in (
            "transformers",
            "safetensors",
            "msgspec",
            "cadence.engines.llama.engine",
            "cadence.worker.batch_scheduler",
        )
    ]
    hint = (
        "; run `benchmarks/gpu_check.sh prepare` where pip can reach PyPI and carry "
        "build/gpu-wheels (docs/torch-engine.md, GPU check)"
    )
    if args.device.startswith("cuda"):
        index = int(args.device.partition(":")[2] or 0)
        if not info["cuda_available"]:
            return {
                "status": "stop",
                **info,
                "summary": f"stopped: --device {args.device} asked for, but torch {torch.__version__} "
                f"(CUDA build {torch.version.cuda}) sees no CUDA card",
            }
        if index >= info["cuda_device_count"]:
            return {
                "status": "stop",
                **info,
                "summary": f"stopped: --device {args.device}, but only {info['cuda_device_count']} card(s)",
            }
    if engine_missing:
        return {
            "status": "stop",
            **info,
            "summary": f"stopped: cannot import {', '.join(engine_missing)} ({missing[engine_missing[0]]})"
            + hint,
        }
    where = (
        info["devices"][int(args.device.partition(":")[2] or 0)]["name"]
        if args.device.startswith("cuda")
        else f"cpu, {info['cpus']} cores"
    )
    summary = f"torch {torch.__version__}, cuda {info['cuda_available']}, {args.device}: {where}"
    if missing:
        summary += f"; serving will fail, missing {', '.join(missing)}" + hint
    return {"status": "ok" if not missing else "warn", "summary": summary, **info}


# -- shared helpers -------------------------------------------------------------------------


def check_prompts(vocab: int, count: int) -> list[list[int]]:
    """Token-id prompts of mixed lengths (1 to 60 tokens), deterministic."""
    import torch

    gen = torch.Generator().manual_seed(7)
    lengths = [1, 5, 17, 33, 60, 9, 2, 24][:count]
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_requests(engine, requests: list[tuple[list[int], int, int]], max_batch: int = 64):
    """Step (prompt, max_tokens, join_step) requests through a BatchScheduler; tokens of each."""
    from cadence.vocabulary import AddRequest
    from cadence.worker.batch_scheduler import BatchScheduler

    scheduler = BatchScheduler(engine, 0, max_batch)
    tokens: list[list[int]] = [[] for _ in requests]
    step = 0
    while step == 0 or scheduler.has_work or any(j >= step for _, _, j in requests):
        for i, (prompt, n, join) in enumerate(requests):
            if join == step:
                failed = scheduler.add(AddRequest(i, prompt, n))
                if failed is not None:
                    raise RuntimeError(f"request {i} refused: {failed.message}")
        out = scheduler.step()
        for seq_id, token in zip(out.seq_ids if out else [], out.token_ids if out else []):
            tokens[seq_id].append(token)
        step += 1
        if step > 10_000:
            raise RuntimeError("the scheduler never finished")
    return tokens


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """How many sequences match exactly, and where the others first differ."""
    diffs = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            first = next((k for k, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            diffs.append({"seq": i, "first_diff": first, "got": g, "want": w})
    return {"equal": len(got) - len(diffs), "of": len(got), "diffs": diffs[:4]}


def hf_model(folder, device: str, dtype_name: str):
    """transformers' model on a device and dtype (cached)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = (str(folder), device, dtype_name)
    if key not in _HF:
        _HF.clear()
        free_cuda()
        _HF[key] = (
            AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_name))
            .to(device)
            .eval()
        )
    return _HF[key]


_HF: dict = {}


def hf_greedy_on(folder, prompt: list[int], n: int, device: str, dtype_name: str) -> list[int]:
    import torch

    model = hf_model(folder, device, dtype_name)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def make_engine(folder: str, device: str, dtype: str, kv_tokens: int, graphs: bool = True, **tp):
    from cadence.config import EngineConfig
    from cadence.engines.llama.engine import LlamaEngine

    config = EngineConfig(
        name="torch",
        model=folder,
        kv_cache_tokens=kv_tokens,
        dtype=dtype,
        threads=max(1, (os.cpu_count() or 1) // tp.get("group_size", 1)),
        cuda_graph_batch=32 if graphs else 0,
    )
    return LlamaEngine(config, device, **tp)


# -- engine and bf16 ------------------------------------------------------------------------


def stage_engine(args, ctx) -> dict:
    folder, n = ctx["folder"], args.check_tokens
    prompts = check_prompts(ctx["vocab"], 8 if not args.quick else 5)
    want = reference(args, ctx)
    engine = make_engine(str(folder), args.device, "float32", 4096)
    try:
        engine.start()
        alone = [run_requests(engine, [(p, n, 0)])[0] for p in prompts]
        together = run_requests(engine, [(p, n, 0) for p in prompts])
        joining = run_requests(engine, [(p, n, i) for i, p in enumerate(prompts)])
        graphs = engine.graphs
        graph_use = (
            {"replays": graphs.replays, "failed": graphs.failed, "buckets": graphs.shapes}
            if graphs is not None
            else None
        )
    finally:
        engine.close()
        del engine
        free_cuda()
    parts = {
        "alone": compare(alone, want),
        "batch_together": compare(together, want),
        "batch_joining": compare(joining, want),
    }
    ok = all(not r["diffs"] for r in parts.values())
    summary = ", ".join(f"{k} {r['equal']}/{r['of']}" for k, r in parts.items())
    return {
        "status": "pass" if ok else "fail",
        "device": args.device,
        "dtype": "float32",
        "cuda_graphs": graph_use,
        "max_tokens": n,
        "prompt_lengths": [len(p) for p in prompts],
        "summary": f"greedy tokens equal transformers': {summary}",
        **parts,
    }


def stage_bf16(args, ctx) -> dict:
    folder, n = ctx["folder"], args.check_tokens
    prompts = check_prompts(ctx["vocab"], 8 if not args.quick else 5)
    want = [hf_greedy_on(folder, p, n, args.device, "bfloat16") for p in prompts]
    engine = make_engine(str(folder), args.device, "bfloat16", 4096)
    try:
        engine.start()
        together = run_requests(engine, [(p, n, 0) for p in prompts])
    finally:
        engine.close()
        del engine
        _HF.clear()
        free_cuda()
    result = compare(together, want)
    prefix = [d["first_diff"] for d in result["diffs"]]
    agree = sum(a == b for g, w in zip(together, want) for a, b in zip(g, w))
    total = sum(min(len(g), len(w)) for g, w in zip(together, want))
    return {
        "status": "ok",
        "note": "agreement only: bf16 rounding differs between implementations",
        "summary": f"bf16 vs transformers bf16 on {args.device}: {result['equal']}/{result['of']} "
        f"sequences identical, {agree}/{total} tokens at equal positions agree"
        + (f", first divergence at steps {prefix}" if prefix else ""),
        "token_agreement": agree / max(total, 1),
        **result,
    }


# -- served ---------------------------------------------------------------------------------


async def _stream_all(target: str, prompts: list, n: int) -> list[list[int]]:
    from cadence.client import AsyncClient

    async with AsyncClient(target) as client:

        async def one(p) -> list[int]:
            got: list[int] = []
            async for chunk in client.generate(p, max_tokens=n, timeout=120):
                got.extend(chunk.token_ids)
            return got

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def served_check(
    folder, n: int, want_ids: list[list[int]], want: list[list[int]], serve_args: list[str]
) -> dict:
    from transformers import AutoTokenizer

    from cadence.client import Client
    from cadence.lab.servers.server_process import ServerProcess
    from tests.llama_models import PROMPTS, hf_greedy

    tok = AutoTokenizer.from_pretrained(folder)
    text_ids = [tok(p).input_ids for p in PROMPTS]
    text_want = [hf_greedy(folder, ids, n) for ids in text_ids]
    start = time.monotonic()
    with ServerProcess(
        "--engine",
        "torch",
        "--model",
        str(folder),
        "--kv-cache-tokens",
        "4096",
        "--dtype",
        "float32",
        "--startup-timeout",
        "180",
        *serve_args,
    ) as server:
        ready_s = time.monotonic() - start
        texts = asyncio.run(_stream_all(server.target, PROMPTS, n))
        ids = asyncio.run(_stream_all(server.target, want_ids, n))
        with Client(server.target) as client:  # the blocking client too
            sync_one = [
                t
                for c in client.generate(want_ids[0], max_tokens=n, timeout=120)
                for t in c.token_ids
            ]
    parts = {
        "text_prompts": compare(texts, text_want),
        "token_prompts": compare(ids, want),
        "sync_client": compare([sync_one], want[:1]),
    }
    ok = all(not r["diffs"] for r in parts.values())
    summary = ", ".join(f"{k} {r['equal']}/{r['of']}" for k, r in parts.items())
    return {
        "status": "pass" if ok else "fail",
        "serve_args": serve_args,
        "server_ready_s": round(ready_s, 1),
        "summary": summary,
        **parts,
    }


def device_spec(device: str) -> list[str]:
    return ["--devices", device if device.startswith("cuda") else "cpu:1"]


def stage_served(args, ctx) -> dict:
    prompts = check_prompts(ctx["vocab"], 8 if not args.quick else 5)
    result = served_check(
        ctx["folder"], args.check_tokens, prompts, reference(args, ctx), device_spec(args.device)
    )
    result["summary"] = f"cadence serve {' '.join(result['serve_args'])}: {result['summary']}"
    return result


# -- tp -------------------------------------------------------------------------------------


def tp_rank_main(argv: list[str]) -> None:
    """One TP rank (started by stage_tp): rank 0 prints the tokens as JSON."""
    folder, rank, size, init, device, requests = argv
    engine = make_engine(
        folder, device, "float32", 4096, rank=int(rank), group_size=int(size), dist_init=init
    )
    if engine.rank > 0:
        engine.follow()
        return
    try:
        engine.start()
        tokens = run_requests(engine, [tuple(r) for r in json.loads(requests)])
    finally:
        engine.close()
    print(json.dumps(tokens), flush=True)


def stage_tp(args, ctx) -> dict:
    import torch

    if args.device.startswith("cuda"):
        cards = torch.cuda.device_count()
        if cards < 2:
            return {"status": "skipped", "summary": f"skipped: {cards} card", "cards": cards}
        devices = ["cuda:0", "cuda:1"]
        serve = ["--devices", "cuda:0,1", "--tp", "2"]
    else:
        devices = ["cpu", "cpu"]
        serve = ["--devices", "cpu:2", "--tp", "2"]
    folder, n = ctx["folder"], args.check_tokens
    prompts = check_prompts(ctx["vocab"], 8 if not args.quick else 5)
    want = reference(args, ctx)
    requests = json.dumps([[p, n, i // 2] for i, p in enumerate(prompts)])
    result: dict = {"devices": devices}
    with tempfile.TemporaryDirectory(prefix="cadence-gpu-check-tp-") as store:
        ranks = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--tp-rank",
                    str(folder),
                    str(r),
                    "2",
                    f"file://{store}/s",
                    devices[r],
                    requests,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = []
        try:
            for p in ranks:
                outs.append(p.communicate(timeout=240))
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    codes = [p.returncode for p in ranks]
    if any(codes):
        err = " | ".join(o[1].strip().splitlines()[-1] for o in outs if o[1].strip())
        raise RuntimeError(f"a TP rank failed, exit codes {codes}: {err[-600:]}")
    engine_tp = compare(json.loads(outs[0][0].strip().splitlines()[-1]), want)
    result["engine_tp2"] = engine_tp
    status = "pass" if not engine_tp["diffs"] else "fail"
    summary = f"engine 2 ranks on {','.join(devices)}: {engine_tp['equal']}/{engine_tp['of']}"
    if args.quick and not args.device.startswith("cuda"):
        result["served_tp2"] = "skipped: --quick on cpu"
    else:
        try:
            served = served_check(folder, n, prompts, want, serve)
            result["served_tp2"] = served
            summary += f"; cadence serve {' '.join(serve)}: {served['summary']}"
            if served["status"] != "pass":
                status = "fail"
        except Exception as exc:
            result["served_tp2"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            summary += f"; served TP error: {type(exc).__name__}: {exc}"[:300]
            status = "fail"
    return {"status": status, "summary": summary, **result}


# -- perf -----------------------------------------------------------------------------------


def measure(engine, batch: int, prompt: int, tokens: int, vocab: int) -> dict:
    from torch_engine import prompts as bench_prompts

    batch_prompts = bench_prompts(batch, prompt, vocab, vary=True)
    from cadence.vocabulary import AddRequest
    from cadence.worker.batch_scheduler import BatchScheduler

    # Warm-up at this batch size (kernel selection, allocator), then the timed run.
    for n_tokens in (min(4, tokens), tokens):
        scheduler = BatchScheduler(engine, 0, 1024)
        for i, p in enumerate(batch_prompts):
            scheduler.add(AddRequest(i, p, n_tokens))
        steps = []
        start = time.perf_counter()
        while scheduler.has_work:
            out = scheduler.step()  # ends in .tolist(): the device is synchronised
            steps.append((out.end_ns - out.start_ns) / 1e6)
        wall = time.perf_counter() - start
    decode = steps[1:] or steps
    return {
        "batch": batch,
        "tokens_per_s": round(batch * tokens / wall, 1),
        "prefill_step_ms": round(steps[0], 3),
        "decode_step_ms": round(statistics.mean(decode), 3),
        "decode_step_p50_ms": round(statistics.median(decode), 3),
        "decode_tokens_per_s": round(batch / (statistics.mean(decode) / 1e3), 1),
    }


def hf_per_token_ms(folder, device: str, dtype: str, prompt: list[int], tokens: int) -> float:
    """transformers' per-token time at batch 1: (generate N - generate 1) / (N - 1)."""
    import torch

    model = hf_model(folder, device, dtype)
    ids = torch.tensor([prompt], device=device)

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)
    t1 = min(timed(1) for _ in range(2))
    tn = min(timed(tokens) for _ in range(2))
    return (tn - t1) / (tokens - 1) * 1e3


def stage_perf(args, ctx) -> dict:
    import torch
    from torch_engine import SHAPES, make_model
    from torch_engine import prompts as bench_prompts

    batches = [int(b) for b in args.batches.split(",")]
    runs: dict = {}
    lines = []
    errors = 0
    for size in args.sizes.split(","):
        folder = make_model(size, Path(ctx["tmp"]) / f"perf-{size}")
        vocab = SHAPES[size]["vocab_size"]
        kv = max(batches) * (args.prompt * 3 // 2 + args.tokens + 32) + 1024
        for dtype, graphs in (
            (d, g) for d in args.dtypes.split(",") for g in args.graphs.split(",")
        ):
            key = f"{size}/{dtype}/graphs-{graphs}"
            if elapsed() > args.budget_s:
                runs[key] = {"status": "skipped", "reason": f"time budget {args.budget_s} s spent"}
                lines.append(f"{key} skipped (budget)")
                continue
            entry: dict = {"dtype": dtype, "size": size, "runs": []}
            runs[key] = entry
            try:
                if args.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                start = time.monotonic()
                engine = make_engine(str(folder), args.device, dtype, kv, graphs=graphs == "on")
                engine.start()
                entry["load_and_warmup_s"] = round(time.monotonic() - start, 2)
                try:
                    for b in batches:
                        r = measure(engine, b, args.prompt, args.tokens, vocab)
                        entry["runs"].append(r)
                        print(
                            f"  perf {key:>14} batch={b:>3}: {r['tokens_per_s']:9.1f} tok/s, "
                            f"decode step {r['decode_step_ms']:7.2f} ms "
                            f"(p50 {r['decode_step_p50_ms']:.2f}), prefill step "
                            f"{r['prefill_step_ms']:7.2f} ms",
                            flush=True,
                        )
                finally:
                    engine.close()
                    del engine
                    free_cuda()
                if args.device.startswith("cuda"):
                    entry["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                if 1 in batches:
                    try:
                        hf = hf_per_token_ms(
                            folder,
                            args.device,
                            dtype,
                            bench_prompts(1, args.prompt, vocab, vary=False)[0],
                            args.tokens,
                        )
                        b1 = next(r for r in entry["runs"] if r["batch"] == 1)["decode_step_ms"]
                        entry["transformers_per_token_ms_b1"] = round(hf, 3)
                        entry["engine_step_ratio_b1"] = round(b1 / hf, 3)
                    except Exception as exc:
                        entry["transformers_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    finally:
                        _HF.clear()
                        free_cuda()
                entry["status"] = "ok"
                best = max(entry["runs"], key=lambda r: r["tokens_per_s"])
                lines.append(
                    f"{key} b{best['batch']} {best['tokens_per_s']:.0f} tok/s"
                    + (
                        f" (b1 step {entry['engine_step_ratio_b1']}x transformers)"
                        if "engine_step_ratio_b1" in entry
                        else ""
                    )
                )
            except Exception as exc:
                errors += 1
                entry["status"] = "error"
                entry["error"] = f"{type(exc).__name__}: {exc}"[:400]
                entry["traceback"] = traceback.format_exc()[-3000:]
                lines.append(f"{key} error {type(exc).__name__}")
                free_cuda()
            # Each finished entry is on disk at once: a run cut off by its time limit
            # keeps the entries before it.
            ctx["report"].data["stages"]["perf"] = {"status": "running", "results": runs}
            ctx["report"].write()
    return {
        "status": "ok" if not errors else "error",
        "device": args.device,
        "prompt": args.prompt,
        "tokens": args.tokens,
        "batches": batches,
        "summary": "; ".join(lines),
        "results": runs,
    }


# -- main -----------------------------------------------------------------------------------


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--tp-rank":
        tp_rank_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(ROOT / "results" / "gpu_check"),
        help="folder for gpu_check.json (default $OUT, else results/gpu_check)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: tiny model only, batch 1 and 4, few tokens, no served TP",
    )
    p.add_argument("--stages", default="engine,bf16,served,tp,perf")
    p.add_argument("--sizes", default=None, help="perf sizes (default tiny,100m; --quick: tiny)")
    p.add_argument("--batches", default=None, help="perf batches (default 1,8,32; --quick: 1,4)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--graphs",
        default="on,off",
        help="perf with CUDA graphs for decode on, off, or both (default on,off)",
    )
    p.add_argument("--prompt", type=int, default=None, help="perf prompt length (32; --quick 16)")
    p.add_argument(
        "--tokens", type=int, default=None, help="perf tokens per request (64; --quick 8)"
    )
    p.add_argument(
        "--check-tokens",
        type=int,
        default=None,
        help="tokens per request in the correctness stages (16; --quick 8)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="perf runs not started after this many seconds are skipped (default 360)",
    )
    args = p.parse_args()
    stages = args.stages.split(",")
    unknown = set(stages) - {"engine", "bf16", "served", "tp", "perf"}
    if unknown:
        p.error(f"unknown stages {sorted(unknown)}")
    q = args.quick
    args.sizes = args.sizes or ("tiny" if q else "tiny,100m")
    args.batches = args.batches or ("1,4" if q else "1,8,32")
    args.prompt = args.prompt or (16 if q else 32)
    args.tokens = args.tokens or (8 if q else 64)
    args.check_tokens = args.check_tokens or (8 if q else 16)

    report = Report(Path(args.out), sys.argv[1:])
    print(f"gpu_check: writing {report.path}", flush=True)
    env = report.stage("env", stage_env, args)
    if env["status"] == "stop":
        report.data["verdict"] = env["summary"]
        report.write()
        return 2

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="cadence-gpu-check-") as tmp:
        ctx: dict = {"tmp": tmp, "report": report}
        model = report.stage("model", _stage_model, ctx)
        checks = {
            "engine": stage_engine,
            "bf16": stage_bf16,
            "served": stage_served,
            "tp": stage_tp,
            "perf": stage_perf,
        }
        for name in stages:
            if name != "perf" and model["status"] == "error":
                report.stage(name, lambda: {"status": "error", "summary": "no test model"})
                continue
            report.stage(name, checks[name], args, ctx)
    statuses = {k: v["status"] for k, v in report.data["stages"].items()}
    report.data["verdict"] = statuses
    report.write()
    print(
        f"gpu_check: done in {elapsed():.0f} s: {json.dumps(statuses)}; wrote {report.path}",
        flush=True,
    )
    return 0 if not any(s in ("fail", "error") for s in statuses.values()) else 1


def _stage_model(ctx) -> dict:
    from tests.llama_models import save_model

    folder = save_model(Path(ctx["tmp"]) / "check-model")
    config = json.loads((folder / "config.json").read_text())
    ctx["folder"], ctx["vocab"] = folder, config["vocab_size"]
    return {
        "status": "ok",
        "summary": f"tiny random LlamaForCausalLM (vocab {config['vocab_size']},"
        f" hidden {config['hidden_size']}, {config['num_hidden_layers']} layers) with tokenizer",
    }


def reference(args, ctx) -> list[list[int]]:
    """transformers' greedy tokens of the check prompts on CPU in float32, as the tests make them."""
    from tests.llama_models import hf_greedy

    if "want" not in ctx:
        prompts = check_prompts(ctx["vocab"], 8 if not args.quick else 5)
        ctx["want"] = [hf_greedy(ctx["folder"], p, args.check_tokens) for p in prompts]
    return ctx["want"]


if __name__ == "__main__":
    sys.exit(main())
