"""Risk certification of KV cache transfers: conformal risk control and Learn-then-Test thresholds."""
