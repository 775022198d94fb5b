"""Structured-output grammar backends. `plugin.py` registers them; each backend module imports its grammar engine
only when the backend is built, so a missing optional engine costs nothing until a request asks for it."""
