"""The ground floor: facts about a model and its KV cache that the engine and the KV transfer
code both need, and the grammar of the values the configuration checks; nothing here runs a
model or opens a socket. Every module imports only the standard library, torch and other
modules of this package.

- model_config.py   a model's architecture (`ModelArchConfig`, MLA, MoE, Mamba2, YaRN)
- tp_split.py       how heads split over tensor-parallel ranks (`RankShard`, `TPSplitError`)
- mamba_shard.py    what one rank holds of a Mamba2 mixer (`Mamba2Shard`)
- kv_groups.py      which layers share a KV cache group (`KVCacheKind`, `LayerGroup`)
- kv_cache_layout.py  how a block's bytes are laid out (pages, kernel blocks, Mamba states)
- dtypes.py         the dtype names a configuration may give
- cpu_lists.py      the grammar of a --cpu-bind value
- hosts.py          what a host string names (an address, or the unspecified one)
"""
