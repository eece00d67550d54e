"""Embeddings and rerank over HTTP: OpenAI's ``/v1/embeddings`` and the shared ``/v1/rerank`` shape, parsed (:mod:`.api`) and rendered (:mod:`.render`)."""
