"""Side effects: storage, collectives, hooks."""
