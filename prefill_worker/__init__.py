"""prefill_worker package."""
