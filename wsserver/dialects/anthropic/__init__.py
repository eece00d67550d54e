"""Anthropic's Messages API: bodies and content blocks parsed (:mod:`.api`, :mod:`.content`), its events and message rendered (:mod:`.render`)."""
