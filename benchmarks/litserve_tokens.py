"""A healthy peer server for benchmarks/false_alarms.py: LitServe streaming one token every
10 ms to every request at once, behind its OpenAI spec (/v1/chat/completions, SSE).

    /work/venvs/litserve/bin/python benchmarks/litserve_tokens.py --port P

Run by the python of LitServe's own venv (`python3 -m venv /work/venvs/litserve &&
/work/venvs/litserve/bin/pip install litserve`): LitServe brings FastAPI, which the project's
environment leaves out. The API is asynchronous (`enable_async`), so its one worker streams
every request at once, each on its own `asyncio.sleep` (as examples/token_app.py does in
cadence): nothing is batched, queued behind another request or computed, so a healthy lab
finds nothing here. Prints READY before it serves.
"""

import argparse
import asyncio

import litserve as ls

GAP_S = 0.01


class Tokens(ls.LitAPI):
    def setup(self, device: str) -> None:
        pass

    async def decode_request(self, request):
        return request.max_tokens or 16

    async def predict(self, count: int):
        for i in range(count):
            await asyncio.sleep(GAP_S)
            yield "ab"[i % 2]

    async def encode_response(self, outputs):
        async for piece in outputs:
            yield {"role": "assistant", "content": piece}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    api = Tokens(stream=True, enable_async=True, spec=ls.OpenAISpec())
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=1, timeout=600)
    print("READY", flush=True)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
