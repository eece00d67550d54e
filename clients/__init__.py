"""Resource anchor for the files wsserver serves; not code.

The build maps this directory to the package ``wsserver.clients``
(pyproject.toml, ``[tool.setuptools.package-dir]``), so ``web/`` (the chat
page) and ``js/`` (the JS client and its types) ship in the wheel as package
data, and ``importlib.resources.files("wsserver.clients")`` finds them both
there and, through the editable install, here in the checkout. This file makes
the package a regular one: setuptools' editable finder cannot resolve a
namespace package that lives outside its parent's directory.
"""
