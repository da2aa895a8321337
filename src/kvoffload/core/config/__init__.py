"""The configuration a user writes (``kv_connector_extra_config``), checked.

- :mod:`.options`: every option, declared once (its default, its check, its docs
  text), and :func:`~.options.default`, where every other module reads a default
  (the typed config, the share's settings, the simulator's settings, the scheduler's
  and workers' parameters); kvoffload's own options are declared in :mod:`.own_options`,
  where the modules the tiers import read theirs;
- :mod:`.capacity`: how many host slots a memory budget holds (one computation);
- :mod:`.sections`: a config section (a tier's options, declared by the tier's spec)
  and the values a tier's builders read;
- :mod:`.typed`: :class:`~.typed.OffloadConfig`, the validated configuration.

Pure Python: no torch, no vLLM.
"""
