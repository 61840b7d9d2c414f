"""Commands beside training: merge, convert, the demo, and tiny models for tests and benchmarks."""
