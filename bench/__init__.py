"""The benchmark harness: ``python -m bench`` (see ``bench/__main__.py``).

Fifteen sections (``bench.analysis.SECTIONS``) measure wsserver side by side
with in-process llama-cpp-python, ``llama_cpp.server`` and llama.cpp's
``llama-server``, and the server itself on the fake backend. They share one
harness: the servers (``servers``), the clients that read them (``wsload``,
``contenders``), the timing and statistics (``timing``) and the report
(``figures``, ``analysis``, ``report``); a section is what it runs, against
whom, and which figures it reports. Results go to docs/benchmarks.md (+ JSON
and plots).
"""
