"""kvserve: a compact LLM serving engine built around leak-proof KV-cache management."""

__version__ = "0.1.0"
