"""Composition orchestration: the request pipeline, field edits, the fidelity guard and prefix refinement."""
