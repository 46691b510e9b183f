"""The control plane between D and P: P's side-channel server and D's client, their frames, the
handshake payload and D's handshakes, and the lease control messages (no KV bytes move here)."""
