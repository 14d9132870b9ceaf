// modeld's Node.js client: loads the .proto files from proto/ at run time
// with @grpc/proto-loader, so it never drifts from the daemon's contract.
'use strict';

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_DIR = path.resolve(__dirname, '..', '..', 'proto');
const LOADER_OPTIONS = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };
const CHANNEL_OPTIONS = { 'grpc.max_receive_message_length': 256 * 1024 * 1024 };

function loadPackage(file) {
  const definition = protoLoader.loadSync(path.join(PROTO_DIR, file), LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition);
}

// BYTES tensors: each element is a 4-byte little-endian length, then the bytes.
function encodeBytesTensor(strings) {
  const parts = [];
  for (const s of strings) {
    const data = Buffer.from(s, 'utf8');
    const length = Buffer.alloc(4);
    length.writeUInt32LE(data.length, 0);
    parts.push(length, data);
  }
  return Buffer.concat(parts);
}

function decodeFp32(raw) {
  const copy = Buffer.from(raw);  // aligned copy for the typed-array view
  return new Float32Array(copy.buffer, copy.byteOffset, copy.length / 4);
}

// TLS when any of tls, caFile, certFile, keyFile is given; without caFile
// the system's roots are trusted. certFile and keyFile: mutual TLS.
function channelCredentials({ tls = false, caFile, certFile, keyFile } = {}) {
  if (!(tls || caFile || certFile || keyFile)) return grpc.credentials.createInsecure();
  if (Boolean(certFile) !== Boolean(keyFile)) throw new Error('mutual TLS needs both certFile and keyFile');
  const read = (file) => (file ? fs.readFileSync(file) : null);
  return grpc.credentials.createSsl(read(caFile), read(keyFile), read(certFile));
}

class ModeldClient {
  /**
   * options: deadlineMs; token (sent as 'authorization: Bearer <token>' on
   * every call); tls, caFile, certFile, keyFile; serverName (the name in the
   * daemon's certificate when the address is not it).
   */
  constructor(address = '127.0.0.1:8001', options = {}) {
    const { deadlineMs = 30000, token, serverName } = options;
    const inference = loadPackage('inference.proto').inference;
    const health = loadPackage('health.proto').grpc.health.v1;
    const credentials = channelCredentials(options);
    const channelOptions = { ...CHANNEL_OPTIONS };
    if (serverName) channelOptions['grpc.ssl_target_name_override'] = serverName;
    this.inference = new inference.GRPCInferenceService(address, credentials, channelOptions);
    this.healthStub = new health.Health(address, credentials, channelOptions);
    this.deadlineMs = deadlineMs;
    // per-call metadata rather than call credentials: grpc-js refuses those
    // on plaintext channels, and a mesh may terminate TLS in front of us
    this.metadata = new grpc.Metadata();
    if (token) this.metadata.set('authorization', `Bearer ${token}`);
  }

  _call(stub, method, request) {
    const deadline = new Date(Date.now() + this.deadlineMs);
    return new Promise((resolve, reject) => {
      stub[method](request, this.metadata, { deadline }, (err, response) => (err ? reject(err) : resolve(response)));
    });
  }

  /** 'SERVING' or 'NOT_SERVING'; service '' is the daemon, a model name that model. */
  async health(service = '') {
    const response = await this._call(this.healthStub, 'Check', { service });
    return response.status;
  }

  /** Sentence embeddings from a text model: an array of Float32Array rows. */
  async embed(texts, model = 'minilm') {
    const request = {
      model_name: model,
      inputs: [{ name: 'text', datatype: 'BYTES', shape: [texts.length] }],
      raw_input_contents: [encodeBytesTensor(texts)],
    };
    const response = await this._call(this.inference, 'ModelInfer', request);
    const index = response.outputs.findIndex((o) => o.name === 'embedding');
    if (index < 0) throw new Error(`model ${model} returned no 'embedding' output`);
    const [rows, dim] = response.outputs[index].shape.map(Number);
    const flat = decodeFp32(response.raw_output_contents[index]);
    return Array.from({ length: rows }, (_, r) => flat.slice(r * dim, (r + 1) * dim));
  }

  close() {
    this.inference.close();
    this.healthStub.close();
  }
}

module.exports = { ModeldClient, channelCredentials, encodeBytesTensor };
