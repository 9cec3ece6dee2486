"""Messages in and out: the publish pipeline (PUBLISH -> store -> PUBACK), the delivery engine
(new-data events -> pulls -> PUBLISH), backlogs, history (subscribing from the past), retained."""
