"""Cross-model KV transfer: calibration statistics, mappers, and applying a transfer (split transfer with repair)."""
