"""A host-memory tier shared by every engine on a node, that outlives any engine.

Engines that name the same share (``"host_share": "NAME"``) use one set of host slots
in shared memory (``/dev/shm``): one copy of each chunk, whoever stored it. Its
directory lives in a small node process (one per share) that engines call over a Unix
socket, and that mirrors the readable set into a shared-memory index engines look up
directly; the slots are mapped by every engine's workers directly. Decision 0016
(``docs/decisions/0016-node-shared-host-tier.md``) gives the design and measurements.

- :mod:`.paths`: the share's files, in a directory of this user's own, opened and
  made by :mod:`kvoffload.core.private_files` so that no other local user can plant or
  read one; :mod:`.peer`: who is on the other end of the socket; :mod:`.users`: engines
  attached; :mod:`.lifecycle`: the verified ``stop`` and the exact ``remove``
  (decision 0018); :mod:`.geometry`: its shape, slab id and meta file;
- :mod:`.protocol`: the wire format; :mod:`.book`, :mod:`.dispatch`, :mod:`.server`,
  :mod:`.server_start`: the node process (its directory and sessions, request
  handling, socket loop, start-up);
- :mod:`.fence`: fencing node-process generations; :mod:`.launch`: starting a node
  process from an engine; :mod:`.serve`: ``kvoffload share serve|stop|remove``;
- :mod:`.index`: the readable set in shared memory (written by the node process);
- :mod:`.connection`, :mod:`.link`, :mod:`.lease`, :mod:`.bookings`, :mod:`.attachment`,
  :mod:`.queries`, :mod:`.client`: the engine's side of the directory
  (:class:`~.client.ShareDirectory`, the interface of the scheduler half's directory);
- :mod:`.slab_files`, :mod:`.slab`: the rank slab files and their mapping
  (:class:`~.slab.SharedSlab`, the interface of the worker's host slab);
- :mod:`.opening`: opening a share from an engine's configuration.

Nothing here imports torch except :mod:`.slab` (the node process never loads it).
"""
