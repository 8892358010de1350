#!/usr/bin/env node
// A gRPC test server that cadence did not write: Node.js @grpc/grpc-js serving the
// ticker.v1.Ticker service (protos/ticker/v1/ticker.proto), with server reflection
// (@grpc/reflection: grpc.reflection.v1 and grpc.reflection.v1alpha).
//
//   node ticker_server.js [--port N] [--host 127.0.0.1] [--no-reflection] [--require-token T]
//                         [--source-files]
//
// --port 0 (the default) binds a free port. Once serving it prints exactly one line to
// stdout, "listening on HOST:PORT"; everything else goes to stderr.
//
// Count: after first_delay_ms sends `count` Ticks (seq 0..count-1) gap_ms apart. Tick k is
// due at t0 + first_delay_ms + k * gap_ms (t0 = when the call arrived), and each timer is set
// for the time that remains to its due time, so lateness does not add up along the stream
// (Node timers have whole-millisecond resolution: a Tick goes out when less than 0.5 ms
// remains, so it can be up to 0.5 ms early). A Tick whose due time has passed goes at once;
// when the call's buffer is full (a slow reader) the stream waits for it to drain.
// Each Tick has words_per_tick words (0 means 1), named w<N> with N counting from
// first_word = seq * words_per_tick, and the request's label. fail_after > 0 ends the call
// with RESOURCE_EXHAUSTED right after that many Ticks (if count reaches it). count < 0 is
// INVALID_ARGUMENT. A cancelled call clears its timer.
// Chat (bidi): the first request is served as Count, then the call ends; later requests are
// ignored. A client that half-closes before sending one gets INVALID_ARGUMENT.
// Once (unary): one Tick (seq 0) after first_delay_ms.
// --require-token T: calls without metadata "authorization: Bearer T" get UNAUTHENTICATED.
// SIGTERM / SIGINT: tryShutdown, forceShutdown after 2 s, exit 0.
//
// Reflection, as stock @grpc/reflection does it, serves the descriptors that
// @grpc/proto-loader makes: ONE file per package, named after it ("ticker_v1.proto", holding
// CountRequest, Tick and Ticker), with an empty dependency list, so the import of
// ticker/v1/tick.proto is not visible. That is what real Node servers serve, so it is the
// default. --source-files serves instead one descriptor per .proto file, under its real name
// and with its real imports, as protoc (or a grpc-go / grpcio server) would: for testing
// clients that follow imports.
'use strict';

const path = require('path');
const { performance } = require('perf_hooks');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { ReflectionService } = require('@grpc/reflection');

const PROTO_ROOT = path.join(__dirname, 'protos');
const PROTO_FILE = 'ticker/v1/ticker.proto';
const USAGE =
  'usage: node ticker_server.js [--port N] [--host HOST] [--no-reflection] ' +
  '[--require-token TOKEN] [--source-files]';

function parseArgs(argv) {
  const opts = { port: 0, host: '127.0.0.1', reflection: true, token: null, sourceFiles: false };
  const value = (i, name) => {
    if (i >= argv.length) fail(`${name} needs a value`);
    return argv[i];
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const eq = arg.indexOf('=');
    const name = arg.startsWith('--') && eq > 0 ? arg.slice(0, eq) : arg;
    const inline = arg.startsWith('--') && eq > 0 ? arg.slice(eq + 1) : null;
    const take = () => (inline !== null ? inline : value(++i, name));
    switch (name) {
      case '--port': {
        const raw = take();
        const port = Number(raw);
        if (!Number.isInteger(port) || port < 0 || port > 65535) fail(`bad --port: ${raw}`);
        opts.port = port;
        break;
      }
      case '--host':
        opts.host = take();
        break;
      case '--no-reflection':
        opts.reflection = false;
        break;
      case '--source-files':
        opts.sourceFiles = true;
        break;
      case '--require-token':
        opts.token = take();
        break;
      case '-h':
      case '--help':
        process.stdout.write(USAGE + '\n');
        process.exit(0);
        break;
      default:
        fail(`unknown argument: ${arg}`);
    }
  }
  return opts;
}

function fail(message) {
  process.stderr.write(`ticker_server: ${message}\n${USAGE}\n`);
  process.exit(2);
}

function statusError(code, details) {
  const err = new Error(details);
  err.code = code;
  err.details = details;
  return err;
}

function authError(call, token) {
  if (token === null) return null;
  const values = call.metadata.get('authorization');
  if (values.length === 1 && String(values[0]) === `Bearer ${token}`) return null;
  return statusError(grpc.status.UNAUTHENTICATED, 'missing or wrong bearer token');
}

function makeTick(seq, request) {
  const perTick = request.words_per_tick > 0 ? request.words_per_tick : 1;
  const first = seq * perTick;
  const words = new Array(perTick);
  for (let i = 0; i < perTick; i++) words[i] = `w${first + i}`;
  return { seq, words, label: request.label, first_word: first };
}

// Streams the Ticks of one Count request into `call` (a server-streaming or bidi call), then
// ends it. Returns a function that stops the stream (clears its pending timer).
function streamTicks(call, request, t0) {
  const count = request.count;
  if (count < 0) {
    call.emit('error', statusError(grpc.status.INVALID_ARGUMENT, 'count must be >= 0'));
    return () => {};
  }
  const firstDelay = Math.max(0, request.first_delay_ms);
  const gap = Math.max(0, request.gap_ms);
  const failAfter = request.fail_after;
  let seq = 0;
  let timer = null;
  let stopped = false;

  const stop = () => {
    stopped = true;
    if (timer !== null) clearTimeout(timer);
    timer = null;
  };

  const step = () => {
    timer = null;
    while (!stopped) {
      if (seq >= count) {
        stopped = true;
        call.end();
        return;
      }
      // Absolute schedule: tick `seq` is due at t0 + firstDelay + seq * gap.
      const remaining = t0 + firstDelay + seq * gap - performance.now();
      if (remaining > 0.5) {
        // setTimeout counts from the event loop's cached (whole-millisecond) clock, so it can
        // fire a little early; the check above then sets a new timer for the rest.
        timer = setTimeout(step, remaining);
        return;
      }
      const flowing = call.write(makeTick(seq, request));
      seq += 1;
      if (failAfter > 0 && seq >= failAfter) {
        stopped = true;
        call.emit(
          'error',
          statusError(grpc.status.RESOURCE_EXHAUSTED, `planted failure after ${seq} ticks`),
        );
        return;
      }
      if (!flowing) {
        // The client (or HTTP/2 flow control) is behind: go on once the buffer drains, so a
        // large count with gap_ms 0 neither buffers without bound nor blocks the event loop.
        call.once('drain', step);
        return;
      }
    }
  };

  step();
  return stop;
}

function count(call) {
  const t0 = performance.now();
  const err = authError(call, options.token);
  if (err) {
    call.emit('error', err);
    return;
  }
  const stop = streamTicks(call, call.request, t0);
  call.on('cancelled', stop);
}

function chat(call) {
  const t0 = performance.now();
  const err = authError(call, options.token);
  if (err) {
    call.on('data', () => {}); // drain whatever the client sends
    call.emit('error', err);
    return;
  }
  let stop = null;
  call.on('data', (request) => {
    if (stop !== null) return; // only the first request counts
    stop = streamTicks(call, request, t0);
  });
  call.on('end', () => {
    if (stop === null) {
      stop = () => {};
      call.emit('error', statusError(grpc.status.INVALID_ARGUMENT, 'Chat needs a CountRequest'));
    }
  });
  call.on('cancelled', () => {
    if (stop !== null) stop();
    stop = () => {};
  });
}

function once(call, callback) {
  const err = authError(call, options.token);
  if (err) {
    callback(err);
    return;
  }
  const delay = Math.max(0, call.request.first_delay_ms);
  const reply = () => callback(null, makeTick(0, call.request));
  if (delay === 0) {
    reply();
    return;
  }
  const timer = setTimeout(reply, delay);
  call.on('cancelled', () => clearTimeout(timer));
}

// One FileDescriptorProto per loaded .proto file (named relative to PROTO_ROOT, with the
// file's own package and imports), encoded, in a stand-in for a package definition that
// ReflectionService reads (it only looks at each entry's fileDescriptorProtos).
function sourceFileDescriptors() {
  const fs = require('fs');
  const protobuf = require('protobufjs');
  const { FileDescriptorProto } = require('protobufjs/ext/descriptor');
  const root = new protobuf.Root();
  root.resolvePath = (origin, target) =>
    path.isAbsolute(target) ? target : path.join(PROTO_ROOT, target);
  root.loadSync(PROTO_FILE, { keepCase: true });
  root.resolveAll();
  const files = new Map();
  for (const file of root.files) {
    const parsed = protobuf.parse(fs.readFileSync(file, 'utf8'), { keepCase: true });
    files.set(
      file,
      FileDescriptorProto.create({
        name: path.relative(PROTO_ROOT, file).split(path.sep).join('/'),
        package: parsed.package || '',
        dependency: parsed.imports || [],
        syntax: 'proto3', // the protos here are all proto3
        messageType: [],
        enumType: [],
        service: [],
      }),
    );
  }
  const visit = (ns) => {
    for (const nested of ns.nestedArray) {
      if (nested instanceof protobuf.Type) {
        files.get(nested.filename).messageType.push(nested.toDescriptor('proto3'));
      } else if (nested instanceof protobuf.Enum) {
        files.get(nested.filename).enumType.push(nested.toDescriptor());
      } else if (nested instanceof protobuf.Service) {
        files.get(nested.filename).service.push(nested.toDescriptor());
      } else if (nested instanceof protobuf.Namespace) {
        visit(nested);
      }
    }
  };
  visit(root);
  const encoded = [...files.values()].map((f) => FileDescriptorProto.encode(f).finish());
  return { files: { fileDescriptorProtos: encoded } };
}

const options = parseArgs(process.argv.slice(2));

function main() {
  const packageDefinition = protoLoader.loadSync(PROTO_FILE, {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const proto = grpc.loadPackageDefinition(packageDefinition);
  const server = new grpc.Server();
  server.addService(proto.ticker.v1.Ticker.service, { Count: count, Chat: chat, Once: once });
  if (options.reflection) {
    const reflected = options.sourceFiles ? sourceFileDescriptors() : packageDefinition;
    new ReflectionService(reflected).addToServer(server);
  }

  const host =
    options.host.includes(':') && !options.host.startsWith('[') ? `[${options.host}]` : options.host;
  server.bindAsync(`${host}:${options.port}`, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      process.stderr.write(`ticker_server: cannot bind ${host}:${options.port}: ${err.message}\n`);
      process.exit(1);
    }
    // Writes to a pipe or file are synchronous in Node on Linux, so this line is out at once.
    process.stdout.write(`listening on ${host}:${port}\n`);
  });

  let stopping = false;
  const shutdown = () => {
    if (stopping) return;
    stopping = true;
    const force = setTimeout(() => {
      server.forceShutdown();
      process.exit(0);
    }, 2000);
    server.tryShutdown(() => {
      clearTimeout(force);
      process.exit(0);
    });
  };
  process.on('SIGTERM', shutdown);
  process.on('SIGINT', shutdown);
}

main();
