"""Test machinery shipped with kvoffload: the byte oracle, scenarios, completion
policies and the interleaving explorer (``python -m kvoffload.testing.explorer``)."""
