"""servesim simulator core: requests, KV cache, scheduler policies, replica engine, CLI."""
