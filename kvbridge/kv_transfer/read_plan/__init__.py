"""Which bytes D reads from which of P's ranks: the read plan, as pure functions.

`tp_mapping` pairs D's ranks with P's (head spans, the request's ReadPlan and the notice that
frees P), `block_mapping` turns logical block ids into kernel block ids with each side's ratio
(and the prefix-cache pairing per group), `mamba_mapping` places a Mamba state's heads and
groups, and `request_reads` joins the three into one request's descriptors over every group.
"""
