"""Building blocks shared by the model families: paged attention, rotary embedding, norms, linears."""
