"""The configuration a user writes (``kv_connector_extra_config``), checked.

- :mod:`.options`: every option, declared once (its default, its check, its docs
  text); the typed config, the share's settings and the simulator's settings take
  their fields and defaults from it;
- :mod:`.sections`: a config section (a tier's options, declared by the tier's spec)
  and the values a tier's builders read;
- :mod:`.typed`: :class:`~.typed.OffloadConfig`, the validated configuration.

Pure Python: no torch, no vLLM.
"""
