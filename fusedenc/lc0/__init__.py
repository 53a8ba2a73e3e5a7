"""Running Leela Chess Zero (lc0) networks with fusedenc."""
