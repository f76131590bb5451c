"""Framework-free definitions: options, semantics, float64 references, chunk plans."""
