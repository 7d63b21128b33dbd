"""tierkv: a tiered, content-addressed KV-cache store."""
