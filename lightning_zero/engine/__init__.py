"""The sharding engine. No Lightning imports: everything here is testable with plain torch."""
