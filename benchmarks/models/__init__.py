"""The models the benchmarks run, and how each is made (benchmarks/README.md, "Models").

`reference_target` rebuilds pyref-7m from the stdlib; `pyref_heads` trains and ships the
committed drafters (benchmarks/heads/); `pyref_deep` and `pyref_wide` grow pyref-7m into
pyref-deep and pyref-1b with the same function; `real_size_checkpoint` writes the
random-weight Llama-3.2-1B-shaped checkpoint.
"""
