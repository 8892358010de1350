#!/usr/bin/env node
// The grpc-js side of benchmarks/native_grpc_wire.py: runs server-streaming calls on
// /cadence.v1.Inference/Generate with @grpc/grpc-js (from tests/node: `npm ci --prefix
// tests/node`) and prints one JSON line per call.
//
//   node benchmarks/native_grpc_wire.js HOST:PORT CASES_JSON
//
// CASES_JSON: [{"name", "request_hex" (a serialized GenerateRequest), "timeout_ms" (0: none),
// "cancel_after" (0: never; else cancel once that many messages have arrived)}]. Per call:
// {name, code, details, trailers (the status event's metadata), messages_hex, started_at_s,
// cancel_at_s, ended_at_s}.
// Times are CLOCK_MONOTONIC seconds (process.hrtime), the clock Python's time.monotonic()
// reads, so the caller can set them beside the server's own event times.
'use strict';

const path = require('path');
const { createRequire } = require('module');

const nodeRequire = createRequire(path.join(__dirname, '..', 'tests', 'node', 'package.json'));
const grpc = nodeRequire('@grpc/grpc-js');

const monotonic = () => Number(process.hrtime.bigint()) / 1e9;

function call(client, c) {
  return new Promise((resolve) => {
    const messages = [];
    let cancelAt = null;
    const startedAt = monotonic();
    const options = c.timeout_ms ? { deadline: Date.now() + c.timeout_ms } : {};
    const stream = client.makeServerStreamRequest(
      '/cadence.v1.Inference/Generate', (b) => b, (b) => b,
      Buffer.from(c.request_hex, 'hex'), new grpc.Metadata(), options);
    stream.on('data', (data) => {
      messages.push(data.toString('hex'));
      if (c.cancel_after && messages.length === c.cancel_after) {
        cancelAt = monotonic();
        stream.cancel();
      }
    });
    stream.on('error', () => {}); // the status event carries the same code and details
    stream.on('status', (status) => {
      resolve({
        name: c.name, code: status.code, details: status.details,
        trailers: status.metadata ? status.metadata.toJSON() : {},
        messages_hex: messages, cancel_at_s: cancelAt, started_at_s: startedAt,
        ended_at_s: monotonic(),
      });
    });
  });
}

async function main() {
  const [target, casesJson] = process.argv.slice(2);
  const client = new grpc.Client(target, grpc.credentials.createInsecure());
  for (const c of JSON.parse(casesJson)) {
    process.stdout.write(JSON.stringify(await call(client, c)) + '\n');
  }
  client.close();
}

main().catch((e) => { console.error(e); process.exit(1); });
