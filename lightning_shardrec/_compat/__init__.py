"""The private names of the libraries below us, one module per library (see each symbol's note)."""
