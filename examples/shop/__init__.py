"""A small shop: an order service that publishes order events through the outbox, and a
shipping consumer that applies them exactly once through the inbox."""
