"""Ollama's native API (``/api/chat``, ``/api/generate``, the model endpoints), sans-I/O."""
