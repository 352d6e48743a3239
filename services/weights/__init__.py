"""Weight transports from the learner to generation: object_store and collective (see base)."""
