"""The core: a request's state and the wire protocol, without I/O.

Protocol v1's frames (:mod:`.protocol`, read by :mod:`.client_frames`), the
session's table (:mod:`.session`, :mod:`.transitions`, :mod:`.events`), a
request's record and replay (:mod:`.request_record`, :mod:`.replay`), the
pacing of frames (:mod:`.pacing`), bytes → text (:mod:`.textstream`), a
connection's lanes (:mod:`.lanes`), what the model registry decides
(:mod:`.models`), and the request's validated input (:mod:`.chat_input`,
:mod:`.sampling`). It loads no engine and no configuration (the layering
test holds it to that); everything else depends on it, it on nothing of theirs.
"""
