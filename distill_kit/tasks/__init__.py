"""Seeded prompt -> answer tasks with exact checkers: benchmarks that need no download and are scored by
whether the student gets the answer right, not by perplexity."""
