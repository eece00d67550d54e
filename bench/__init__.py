"""The benchmark harness: ``python -m bench`` (see ``bench/__main__.py``).

Sections 1-2 compare in-process llama-cpp-python, wsserver and
``llama_cpp.server`` on the same model; sections 3-5 measure the server itself
with the fake backend. Results go to docs/benchmarks.md (+ JSON and plots).
"""
