"""The parameter server's data plane: the pusher's channels and shared-memory segments
(:mod:`.channels`), the node's listeners and connection threads (:mod:`.server`), forwards to
the backups (:mod:`.forward`) and the framing (:mod:`.wire`)."""
