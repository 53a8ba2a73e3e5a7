"""What every layer shares: the dtype and activation vocabularies, device facts, argument
checks, the measured-table file format and torch module helpers.  Imports nothing else of
fusedenc."""

