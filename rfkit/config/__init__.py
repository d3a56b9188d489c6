"""Reading recipes: the LightningCLI wiring, the packaged catalogue, checks that run before any
model loads, one-line parse errors, and loading a ``--model`` given as a directory or a recipe.
"""
