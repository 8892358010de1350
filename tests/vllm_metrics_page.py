"""A metrics page written the way vLLM writes its own, standing in for a foreign server's
Prometheus endpoint in the `cadence bench --scrape` tests.

    python tests/vllm_metrics_page.py [--port 0] [--batch 4]

The values change with the seconds since it started, as a server under a growing load would
show them: the running requests climb to `--batch` and stay there, the waiting ones grow by
four a second, the KV cache fills to 0.6, and the counters grow steadily. It prints
`listening on HOST:PORT` once serving and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import http.server
import signal
import sys
import threading
import time

PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="stand-in"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="stand-in"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="stand-in"}} {kv}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="stand-in"}} {tokens}
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="1.0",model_name="stand-in"}} {done}
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="stand-in"}} {done}
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="stand-in"}} {done}
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="stand-in"}} {latency}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    started = time.monotonic()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            t = time.monotonic() - started
            body = PAGE.format(
                running=min(args.batch, int(4 * t)),
                waiting=int(4 * t),
                kv=round(min(0.6, 0.2 * t), 3),
                tokens=int(500 * t),
                done=int(10 * t),
                latency=round(5 * t, 3),
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_) -> None:
            pass  # a line per scrape would drown the test's output

    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Page)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on 127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
    sys.exit(0)


if __name__ == "__main__":
    main()
