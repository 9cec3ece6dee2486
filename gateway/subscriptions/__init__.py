"""Subscriptions: the SUBSCRIBE / UNSUBSCRIBE handling filter by filter, the registry of who reads
which light queue (one store registration per wildcard filter), shared groups."""
