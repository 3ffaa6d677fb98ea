"""Test helpers that ship with the package (the engine's tests reuse them): host-sync detection, op counts,
saved-for-backward bytes."""
