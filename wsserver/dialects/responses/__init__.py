"""The Responses API: bodies and items parsed (:mod:`.api`, :mod:`.items`), its events and objects rendered (:mod:`.render`), responses kept for previous_response_id (:mod:`.store`)."""
