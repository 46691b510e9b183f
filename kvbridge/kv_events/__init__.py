"""KV cache events: vLLM's wire contract, kvbridge's block hashes, the publisher an instance runs
and the fleet index the router keeps.

- events.py: vLLM's msgspec structs (BlockStored, BlockRemoved, AllBlocksCleared, EventBatch),
  their encoding, and a decoder of both of vLLM's encodings (maps since its PR #42892, arrays before).
- hashing.py: chained SHA-256 block hashes, the same in every process and after restarts.
- config.py: `--kv-events-config`, vLLM's KVEventsConfig fields (loopback by default).
- publisher.py: the ZMQ PUB publisher with vLLM's replay ROUTER, and the null one.
- index.py: the router's per-instance, per-group index of held blocks; gaps, replay, staleness.
- subscriber.py: one instance's SUB + replay DEALER feeding the index.

Ground floor: imports only shape/ (the engine publishes, the proxy indexes).
"""
