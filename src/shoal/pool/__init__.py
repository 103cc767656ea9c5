"""The node's local model pool: which models run here, loading on first use, keep-alive."""
