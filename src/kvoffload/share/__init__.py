"""A directory shared by every engine of a node, in a node process that outlives
any engine: the node-shared form of any tier (decision 0016; which tiers and when:
:mod:`kvoffload.tiers.build`).

Engines that name the same share use one set of slots: one copy of each chunk,
whoever stored it. The share's directory lives in a small node process (one per
share) that engines call over a Unix socket, and that mirrors the readable set into
a shared-memory index engines look up directly; the slots are mapped or opened by
every engine's workers directly. Where the slots are is the share's backing
(:mod:`.backing`): shared-memory slab files (:mod:`.memory_backing`, the default:
the host tier's ``host_share``) or a lower tier's files (the disk tier's, in
:mod:`kvoffload.tiers.disk_backing`). This package names no tier and imports none.

- :mod:`.paths`: the share's files, in a directory of this user's own, opened and
  made by :mod:`kvoffload.core.private_files` so that no other local user can plant or
  read one; :mod:`.peer`: who is on the other end of the socket; :mod:`.users`: engines
  attached; :mod:`.lifecycle`: the verified ``stop`` and the exact ``remove``
  (decision 0018); :mod:`.meta`: its shape, slab id and meta file;
- :mod:`.backing`, :mod:`.memory_backing`, :mod:`.slab_files`: where the slots are,
  the default backing and its rank slab files;
- :mod:`.protocol`: the wire format; :mod:`.book`, :mod:`.dispatch`, :mod:`.server`,
  :mod:`.server_start`: the node process (its directory and sessions, request
  handling, socket loop, start-up);
- :mod:`.fence`: fencing node-process generations; :mod:`.launch`: starting a node
  process from an engine; :mod:`.opening`: waiting for it, session leases;
  :mod:`.serve`: ``kvoffload share serve|stop|remove``;
- :mod:`.index`: the readable set in shared memory (written by the node process);
- :mod:`.connection`, :mod:`.link`, :mod:`.lease`, :mod:`.bookings`, :mod:`.attachment`,
  :mod:`.queries`, :mod:`.client`: the engine's side of the directory
  (:class:`~.client.ShareDirectory`, a
  :class:`~kvoffload.core.directory.HostDirectory`).

Nothing here imports torch (the workers' mapping of a shared-memory slab is
:mod:`kvoffload.tiers.host_shared_slab`).
"""
