"""Tests by layer: unit/ (no model, seconds), integration/ (one file per producer, tiny models), e2e/ (slow)."""
