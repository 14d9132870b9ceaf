// Usage: node example.js [host:port] [sentence]
// Checks the daemon's health and embeds one sentence; prints one JSON line.
'use strict';

const { ModeldClient } = require('./modeld');

async function main() {
  const address = process.argv[2] || '127.0.0.1:8001';
  const sentence = process.argv[3] || 'modeld serves models over gRPC.';
  const client = new ModeldClient(address);
  try {
    const health = await client.health('');
    const [embedding] = await client.embed([sentence]);
    const norm = Math.sqrt(embedding.reduce((sum, v) => sum + v * v, 0));
    console.log(JSON.stringify({ health, dim: embedding.length, norm, head: Array.from(embedding.slice(0, 4)) }));
  } finally {
    client.close();
  }
}

main().catch((err) => {
  console.error(`modeld: ${err.code !== undefined ? grpcName(err.code) + ': ' : ''}${err.details || err.message}`);
  process.exit(1);
});

function grpcName(code) {
  const { status } = require('@grpc/grpc-js');
  return Object.keys(status).find((k) => status[k] === code) || String(code);
}
