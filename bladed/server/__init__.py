"""The bladed daemon (floor 2): socket and lifecycle (:mod:`.daemon`), sessions
(:mod:`.session`), per-channel workers (:mod:`.channel`), metrics
(:mod:`.metrics`) and crash-recovery state (:mod:`.state`)."""
