"""shoal: pool one machine or many into one LLM inference service."""

__version__ = "0.1.0"
