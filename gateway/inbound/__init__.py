"""Messages in: the publish pipeline (PUBLISH -> one store record, batched per loop iteration ->
PUBACK/PUBREC once durable), delayed publishes."""
