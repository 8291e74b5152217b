"""The inference engine: scheduler, KV-cache manager, model runner, sampler, LLM API."""
