"""The wire dialects' halves without I/O: each parses its requests into the
core's ``generate`` frame and renders the core's frames in its own shape.

One package per HTTP API — :mod:`.openai` (chat completions, completions),
:mod:`.responses` (the Responses API), :mod:`.anthropic` (the Messages API),
:mod:`.ollama` (Ollama's API) —
beside what they share: :mod:`.api_errors` (the error object, statuses, the
honour-or-refuse field tables) and :mod:`.exchange` (how every HTTP answer
ends, and the renderer a dialect writes). No dialect imports another's
modules (the layering test). The asyncio halves live in :mod:`wsserver.aio`.
"""
