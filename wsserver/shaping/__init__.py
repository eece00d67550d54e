"""Output shaping, without I/O: the engine's text → text, reasoning and tool-call parts.

:mod:`.shaper` builds one :class:`~wsserver.shaping.shaper.Shaper` per request
from the request and the engine's description of its output; it splits
reasoning (:mod:`.reasoning`), finds tool calls in the text (:mod:`.tool_calls`,
one parser per syntax in :mod:`.text_calls`) or takes an upstream's
(:mod:`.tool_relay`), and streams a call's arguments (:mod:`.call_stream`,
:mod:`.call_parts`, :mod:`.json_text`); :mod:`.logprobs` shapes tokens'
log-probabilities. It depends on the core only.
"""
