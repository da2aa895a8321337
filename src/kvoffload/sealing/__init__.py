"""Sealing: authenticated encryption of every chunk that leaves the engine's own trust
(issue 41, decision 0024).

A tier that other processes or machines can reach (Redis; the disk tier on shared
storage when ``disk_seal`` is set) keeps only sealed chunks once ``seal_key_file`` is
given: AES-256-GCM from ``cryptography``, a fresh random nonce per write, the chunk's
storage key, namespace, KV cache group and format bound in as associated data. A value
that does not open is a counted miss (``integrity:seal``), deleted where the tier can
delete, and recomputed; its bytes never reach the engine.

- :mod:`.layout`: the sealed value's layout and the associated data (no cipher, no
  dependency: the sizes are read by the tier builds);
- :mod:`.keyfile`: the key file (one or several keys; the first seals, all open),
  checked as every file kvoffload trusts;
- :mod:`.sealer`: :class:`~.sealer.Sealer`, sealing and opening one chunk;
- :mod:`.store`: :class:`~.store.SealedStore`, any tier's store with its chunks sealed;
- :mod:`.policy`: which tiers a configuration seals, the start-up text and refusals.
"""
