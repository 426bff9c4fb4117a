"""The inference engine: scheduler, paged KV cache with prefix reuse, runner and sampler."""
