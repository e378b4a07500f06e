"""Code that runs inside a serving engine's own Python (never imported by kvcal itself)."""
