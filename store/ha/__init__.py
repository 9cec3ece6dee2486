"""A replicated store group: the primary ships its CommitLog to replicas; pysyncobj elects (docs/ha.md)."""
