-- The table of the sql-orders example (PostgreSQL).
CREATE TABLE IF NOT EXISTS example_orders (
    order_id    TEXT PRIMARY KEY,
    customer_id BIGINT NOT NULL,
    amount      DOUBLE PRECISION NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
