"""Messages out: the delivery engine (new-data events -> pulls -> offers to the session machine),
the messages this gateway just appended, histories (subscribing from the past), retained messages
on SUBSCRIBE."""
