"""Sessions: multi-turn conversations over composed skills, live KV bounded in memory, saved for other replicas."""
