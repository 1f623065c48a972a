"""History tools over a stream: replay any step, compare, push, verify, collect garbage, statistics."""
