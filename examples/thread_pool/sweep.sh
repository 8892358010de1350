#!/usr/bin/env bash
# A thread pool and one shared queue, measured on examples/thread_pool/server.py: for both designs, vary the
# thread pool's size, then the queue's capacity, one at a time, with the same 32 streams of 64
# tokens (20 ms engine steps); record TTFT, the mean gap and the slowest 10%.
#
#     examples/thread_pool/sweep.sh [OUT_DIR]      (default results/thread_pool)
#
# Each sweep writes OUT_DIR/<design>_<variable>.json and an HTML report with plots in
# OUT_DIR/<design>_<variable>/. About three minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-results/thread_pool}
mkdir -p "$out"
server="${PYTHON:-python3} examples/thread_pool/server.py --port {port} --step-ms 20"
bench=(--protocol grpc --method tokens.v1.TokenService/Generate
       --request-json '{"request_id": "{request_id}", "prompt": "{prompt}", "max_tokens": "{max_tokens}"}'
       --index-field index --concurrency 32 --requests 32 --max-tokens 64 --repeat 2)
for design in shared per-request; do
    name=${design/-/_}
    cadence sweep --server-cmd "$server --design $design --threads {threads}" \
        --vary threads=2,4,8,16,32 "${bench[@]}" \
        --json "$out/${name}_threads.json" --report "$out/${name}_threads"
    cadence sweep --server-cmd "$server --design $design --threads 32 --queue-capacity {capacity}" \
        --vary capacity=1,4,16,64 "${bench[@]}" \
        --json "$out/${name}_capacity.json" --report "$out/${name}_capacity"
done
