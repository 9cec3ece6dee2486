"""What changes when several gateways share one store: session ownership across the fleet,
shared-group leases."""
