"""Who may connect and what they may do: authentication, ACL, MQTT 5 enhanced auth (SCRAM),
the password file and `lmqtt passwd`."""
