"""specx's benchmarks: each script runs as `python -m benchmarks.<script>` from the checkout.

benchmarks/README.md says what each measures and its latest result; `inputs` and `runners`
are the helpers they share, `models/` writes the targets and trains the drafters they run.
"""
