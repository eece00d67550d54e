"""OpenAI's API: chat completions and completions parsed (:mod:`.api`), rendered (:mod:`.render`), its tool calls' shapes (:mod:`.tools`)."""
