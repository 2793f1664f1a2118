"""Building blocks of the native models: paged attention, rotary embedding, norms, sampler."""
